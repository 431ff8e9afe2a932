"""Prompt/response pairs for day 5's fine-tuning (lesson 23), built offline from text every Python has.

The pairs come from Python's documentation topics (pydoc_data.topics, as data_tools/text.py's default corpus;
Python Software Foundation, PSF License): for each section of a topic (a line underlined with *, = or -) the
prompt is a question naming the section and the response the first sentence of its first paragraph:

    prompt:   "Q: The "assert" statement?\nA: "
    response: "Assert statements are a convenient way to insert debugging assertions into a program:"

109 pairs in Python 3.11 (a heading seen again is skipped); every tenth (the 10th, the 20th, ...) is held out.
Tokens are bytes, as in lesson 22 (data_tools/text.py): byte 0 (END) closes each response, so the model
learns where an answer stops.

A row is one pair: its prompt's bytes, its response's, END, then END again as padding up to seq_len + 1
tokens; the input is the row's first seq_len tokens, the targets its last seq_len (the next token at each
position), as in lesson 22.  The target of every position that predicts a token of the prompt, or padding,
is IGNORE (-100, what F.cross_entropy's ignore_index skips): the loss counts the response's tokens and the
END that closes it, nothing else.  A response longer than its row is cut (and then has no END).
"""
import torch

from data_tools.datasets import DataError
from data_tools.text import END

IGNORE = -100  # the target of a position the loss skips (F.cross_entropy's default ignore_index)
HELD_OUT_EVERY = 10
UNDERLINES = set("*=-")


def pairs() -> list:
    """[(prompt, response)] in topic-name order, one per section heading (its first occurrence)."""
    from pydoc_data.topics import topics

    found, seen = [], set()
    for name in sorted(topics):
        lines = topics[name].split("\n")
        for i in range(len(lines) - 3):
            heading, under = lines[i].strip(), lines[i + 1].rstrip()
            if not heading or len(under) < 3 or set(under) - UNDERLINES or lines[i + 2].strip():
                continue
            paragraph = []
            for line in lines[i + 3:]:
                if not line.strip() or line.startswith(" "):
                    break
                paragraph.append(line.strip())
            if paragraph and heading not in seen:
                seen.add(heading)
                found.append((f"Q: {heading}?\nA: ", first_sentence(" ".join(paragraph))))
    return found


def first_sentence(paragraph: str) -> str:
    end = paragraph.find(". ")
    return paragraph if end < 0 else paragraph[:end + 1]


def split(items: list) -> tuple:
    """(training pairs, held-out pairs): every HELD_OUT_EVERY-th is held out."""
    held = set(range(HELD_OUT_EVERY - 1, len(items), HELD_OUT_EVERY))
    return [p for i, p in enumerate(items) if i not in held], [p for i, p in enumerate(items) if i in held]


def row(prompt: str, response: str, seq_len: int) -> tuple:
    """(input, target): two int64 tensors of seq_len tokens; the target IGNORE where the prompt or padding
    would be predicted."""
    p, r = list(prompt.encode()), list(response.encode()) + [END]
    tokens = (p + r)[:seq_len + 1]
    tokens += [END] * (seq_len + 1 - len(tokens))
    target = torch.tensor(tokens[1:])
    target[:len(p) - 1] = IGNORE  # positions 0 .. len(p) - 2 predict the prompt's own bytes
    target[len(p) + len(r) - 1:] = IGNORE  # the padding after the response's END
    return torch.tensor(tokens[:-1]), target


class PromptResponseRows(torch.utils.data.Dataset):
    """One pair a row (see the module's docstring)."""

    def __init__(self, items: list, seq_len: int):
        self.items, self.seq_len = items, seq_len

    def __len__(self):
        return len(self.items)

    def __getitem__(self, i):
        return row(*self.items[i], self.seq_len)


def load(seq_len: int) -> tuple:
    """(training rows, held-out rows, a one-line description)."""
    items = pairs()
    longest = max(len(p.encode()) for p, _ in items)
    if seq_len < longest + 1:
        raise DataError(f"--seq-len {seq_len} is shorter than the longest prompt ({longest} bytes) and one byte of "
                        f"its response; use --seq-len {longest + 1} or more")
    whole = max(len(p.encode()) + len(r.encode()) + 1 for p, r in items)  # the longest pair and its END
    if seq_len > whole:
        raise DataError(f"--seq-len {seq_len} is longer than the longest pair ({whole} bytes with its END): its rows "
                        f"would end in padding only; use --seq-len {whole} or less")
    train, held = split(items)
    cut = sum(len(p.encode()) + len(r.encode()) + 1 > seq_len + 1 for p, r in items)
    said = (f"{len(items)} prompt/response pairs from Python's documentation topics, {len(held)} held out; "
            f"{cut} response(s) cut to fit --seq-len {seq_len}")
    return PromptResponseRows(train, seq_len), PromptResponseRows(held, seq_len), said
