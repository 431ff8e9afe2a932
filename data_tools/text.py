"""Text for day 5's language models, with nothing to download: a corpus, its bytes as tokens, packed rows.

Corpora (--corpus), each in every Python installation, so a compute node without internet has them:
- python-docs (the default): Python's documentation topics as `help()` shows them, bundled with Python as the
  module pydoc_data.topics (79 topics, ~466 000 characters in Python 3.11); each topic is a document.
- python-stdlib: the .py files of the standard library of the Python that runs the lesson, its tests left
  out (Debian's Python 3.11: 638 files, ~11 MB; one document a file).
Both are the Python Software Foundation's, under the PSF License (https://docs.python.org/3/license.html).
- --text-dir DIR instead: every *.txt, *.md and *.rst file under DIR (yours), each file a document.

Tokens are bytes: a text's UTF-8 bytes, 0-255, so the vocabulary is 256 and nothing is trained or saved to
tokenize.  Byte 0 (NUL) never occurs in text: it ends each document (END), so the model learns where a
document stops.  Every tenth document (in name order: the 10th, the 20th, ...) is held out for validation.
Packing: the documents, each followed by END, are laid end to end in name order and cut into rows of
seq_len + 1 tokens that share their edge token (row i is tokens [i * seq_len, (i + 1) * seq_len]): a row's
first seq_len tokens are the input, its last seq_len the targets (the next token at each position).  A row
may hold the end of one document and the start of the next, as GPT-2's and torchtitan's packing do; no
token is padding.  The lesson shuffles the rows with a DistributedSampler.
"""
from pathlib import Path

import torch

from data_tools.datasets import DataError

END = 0  # the token that ends every document: byte 0, NUL, which no text holds
VOCAB = 256  # one token a byte
CORPORA = ("python-docs", "python-stdlib")
TEXT_SUFFIXES = (".txt", ".md", ".rst")
HELD_OUT_EVERY = 10


def documents(corpus: str = "python-docs", text_dir=None) -> list:
    """[(name, bytes)] in name order: the corpus's documents."""
    if text_dir is not None:
        return _from_directory(Path(text_dir))
    if corpus == "python-docs":
        from pydoc_data.topics import topics

        return sorted((name, text.encode()) for name, text in topics.items())
    if corpus == "python-stdlib":
        import sysconfig

        root = Path(sysconfig.get_paths()["stdlib"])
        files = sorted(p for p in root.rglob("*.py") if "site-packages" not in p.parts and "test" not in p.parts)
        return [(str(p.relative_to(root)), p.read_bytes().replace(b"\0", b"")) for p in files]
    raise DataError(f"unknown corpus {corpus!r}: choose one of {', '.join(CORPORA)}, or --text-dir DIR")


def _from_directory(root: Path) -> list:
    if not root.is_dir():
        raise DataError(f"--text-dir {root}: {'not a directory' if root.exists() else 'does not exist'}; give a "
                        f"directory that holds *.txt, *.md or *.rst files")
    found = []
    for path in sorted(p for p in root.rglob("*") if p.suffix in TEXT_SUFFIXES and p.is_file()):
        try:
            data = path.read_bytes()
        except OSError as e:
            raise DataError(f"--text-dir: cannot read {path} ({e.strerror}); fix its permissions or remove "
                            f"it") from None
        if b"\0" in data:
            raise DataError(f"--text-dir: {path} holds NUL bytes, so it is not text (byte 0 ends each document "
                            f"here); remove it from {root} or convert it to plain text")
        if data:
            found.append((str(path.relative_to(root)), data))
    if len(found) < 2:
        raise DataError(f"--text-dir {root}: {len(found)} non-empty *.txt, *.md or *.rst file(s) found; give at "
                        f"least 2 (every tenth is held out for validation, and one at least is)")
    return found


def split(docs: list) -> tuple:
    """(training documents, validation documents): every HELD_OUT_EVERY-th one (at least one) is held out."""
    held = {i for i in range(HELD_OUT_EVERY - 1, len(docs), HELD_OUT_EVERY)} or {len(docs) - 1}
    return [d for i, d in enumerate(docs) if i not in held], [d for i, d in enumerate(docs) if i in held]


def stream(docs: list) -> torch.Tensor:
    """The documents' bytes end to end, each followed by END: a uint8 tensor of tokens."""
    joined = b"".join(data + bytes([END]) for _, data in docs)
    return torch.frombuffer(bytearray(joined), dtype=torch.uint8)


class PackedText(torch.utils.data.Dataset):
    """Rows of seq_len + 1 tokens cut from a stream (see the module's docstring); item i is (input, target),
    two int64 tensors of seq_len tokens, the target the input moved on by one."""

    def __init__(self, tokens: torch.Tensor, seq_len: int, what: str = "text"):
        rows = (len(tokens) - 1) // seq_len
        if rows < 1:
            raise DataError(f"the {what} has {len(tokens)} tokens, fewer than one row of --seq-len {seq_len} + 1; "
                            f"use a shorter --seq-len or more text")
        self.tokens, self.seq_len, self.rows = tokens, seq_len, rows

    def __len__(self):
        return self.rows

    def __getitem__(self, i):
        row = self.tokens[i * self.seq_len:(i + 1) * self.seq_len + 1].long()
        return row[:-1], row[1:]


def load(corpus: str, text_dir, seq_len: int) -> tuple:
    """(training rows, validation rows, a one-line description of the corpus)."""
    docs = documents(corpus, text_dir)
    train, held = split(docs)
    train_tokens, held_tokens = stream(train), stream(held)
    name = f"--text-dir {text_dir}" if text_dir is not None else corpus
    said = (f"{name}: {len(docs)} documents, {len(train_tokens) + len(held_tokens):,} tokens (bytes); "
            f"{len(held)} documents ({len(held_tokens):,} tokens) held out")
    return PackedText(train_tokens, seq_len, "training text"), PackedText(held_tokens, seq_len, "held-out text"), said


def decode(tokens) -> str:
    """Bytes back to text: END as a newline-marked document break, bytes that are not UTF-8 as U+FFFD."""
    data = bytes(int(t) for t in tokens)
    return data.replace(bytes([END]), "\n<|end of document|>\n".encode()).decode("utf-8", errors="replace")


def encode(text: str) -> torch.Tensor:
    return torch.tensor(list(text.encode()), dtype=torch.long)

