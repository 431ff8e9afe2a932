"""Hugging Face's model directory for day 5's GPT (course/gpt.py): config.json, safetensors, their digests.

A Hugging Face model directory holds config.json (the sizes, as `transformers`' LlamaConfig names them) and
the weights in safetensors files: model.safetensors, or model-00001-of-0000N.safetensors with
model.safetensors.index.json naming the file of each tensor.  The course's GPT is laid out and named as
LlamaForCausalLM, so its state dict is such a directory's tensors, name for name.

SHA256SUMS: the course writes one beside what it writes (`sha256sum -c SHA256SUMS` checks it anywhere), and
checks it before reading a directory that has one (a trainer writes one when staging weights: docs/trainers);
a directory without one (as `transformers` saves) is read as it is: safetensors checks each file's header and
sizes as it opens it.
"""
import hashlib
import json
import os
import shutil
from pathlib import Path

from course.launching.cli import CourseError

DIGESTS = "SHA256SUMS"
CONFIG = "config.json"


def default_model_dir() -> Path:
    """$COURSE_MODEL_DIR, a model the trainer staged for the class (docs/trainers/instructor-guide.md), else
    lesson 22's model (its run dir's hf/)."""
    return Path(os.environ.get("COURSE_MODEL_DIR") or Path("runs") / "22_gpt_pretraining" / "hf")


def named(model_dir: Path) -> str:
    """The model dir as a message names it: "(COURSE_MODEL_DIR)" when that variable chose it."""
    staged = os.environ.get("COURSE_MODEL_DIR")
    return f"{model_dir} (COURSE_MODEL_DIR)" if staged and Path(staged) == Path(model_dir) else f"--model-dir {model_dir}"


def staged_problem(model_dir: Path):
    """What is wrong with a model staged for a class, or None: the course's GPT can be it, and it has a
    SHA256SUMS that holds (the readiness check, on every node)."""
    try:
        sizes_of(model_dir)
        if not verify_digests(model_dir):
            return (f"{model_dir} has no {DIGESTS}: write one where the model was staged (cd {model_dir} && "
                    f"sha256sum *.json *.safetensors > {DIGESTS})")
    except CourseError as e:
        return str(e)
    return None


def config_of(sizes: dict, seq_len: int) -> dict:
    """config.json for GPT(**sizes): what LlamaForCausalLM needs to build the same model."""
    return {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": sizes["vocab"],
        "hidden_size": sizes["width"], "intermediate_size": sizes["hidden"], "num_hidden_layers": sizes["depth"],
        "num_attention_heads": sizes["heads"], "num_key_value_heads": sizes["heads"],
        "head_dim": sizes["width"] // sizes["heads"], "hidden_act": "silu", "rms_norm_eps": sizes["eps"],
        "rope_parameters": {"rope_type": "default", "rope_theta": sizes["theta"]}, "rope_theta": sizes["theta"],
        "max_position_embeddings": seq_len, "tie_word_embeddings": False, "attention_bias": False,
        "mlp_bias": False, "bos_token_id": None, "eos_token_id": 0, "pad_token_id": 0, "dtype": "float32",
    }


def sizes_of(model_dir: Path) -> dict:
    """GPT(**sizes) for the model in `model_dir`, or one line saying what the course's GPT cannot be."""
    config = read_config(model_dir)
    if config.get("model_type") != "llama":
        raise CourseError(f"{model_dir / CONFIG}: model_type {config.get('model_type')!r}; the course's GPT reads "
                          f"Llama-layout models (model_type \"llama\")")
    try:
        width, heads = int(config["hidden_size"]), int(config["num_attention_heads"])
        sizes = dict(vocab=int(config["vocab_size"]), width=width, depth=int(config["num_hidden_layers"]),
                     heads=heads, hidden=int(config["intermediate_size"]), eps=float(config.get("rms_norm_eps", 1e-6)))
    except (KeyError, TypeError, ValueError) as e:
        raise CourseError(f"{model_dir / CONFIG}: no valid {e} ; a Llama config names vocab_size, hidden_size, "
                          f"num_hidden_layers, num_attention_heads and intermediate_size") from None
    rope = config.get("rope_parameters") or {}
    sizes["theta"] = float(rope.get("rope_theta", config.get("rope_theta", 10000.0)))
    unlike = [f"{key} {config.get(key)}" for key, ours in (
        ("num_key_value_heads", heads), ("head_dim", width // heads), ("hidden_act", "silu"),
        ("tie_word_embeddings", False), ("attention_bias", False), ("mlp_bias", False))
        if config.get(key, ours) != ours]
    if rope.get("rope_type", "default") != "default" or config.get("rope_scaling"):
        unlike.append("a scaled rotary embedding")
    if unlike:
        raise CourseError(f"{model_dir / CONFIG}: {', '.join(unlike)}: the course's GPT (course/gpt.py) has as many "
                          f"key/value heads as heads, width / heads features a head, SiLU, no biases, an untied "
                          f"head and plain rotary positions; convert the model or choose one with these")
    return sizes


def read_config(model_dir: Path) -> dict:
    model_dir = Path(model_dir)
    if not model_dir.is_dir():
        raise CourseError(f"{named(model_dir)}: {'not a directory' if model_dir.exists() else 'does not exist'}; "
                          f"give a Hugging Face model directory (config.json and *.safetensors), such as lesson "
                          f"22's runs/22_gpt_pretraining/hf")
    try:
        config = json.loads((model_dir / CONFIG).read_text())
    except FileNotFoundError:
        raise CourseError(f"{named(model_dir)}: no {CONFIG}; a Hugging Face model directory has one") from None
    except (OSError, ValueError) as e:
        raise CourseError(f"{model_dir / CONFIG}: cannot be read as JSON ({e}); copy the model directory "
                          f"again") from None
    if not isinstance(config, dict):
        raise CourseError(f"{model_dir / CONFIG}: not a JSON object; copy the model directory again")
    if not sorted(model_dir.glob("*.safetensors")):
        raise CourseError(f"{named(model_dir)}: no *.safetensors file; save the model with safetensors "
                          f"(transformers' save_pretrained does by default)")
    return config


def sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def write_digests(model_dir: Path) -> None:
    """SHA256SUMS for config.json and every *.json and *.safetensors file of `model_dir`, in sha256sum's format."""
    model_dir = Path(model_dir)
    files = sorted(p.name for p in model_dir.iterdir() if p.suffix in (".json", ".safetensors") and p.is_file())
    (model_dir / DIGESTS).write_text("".join(f"{sha256(model_dir / name)}  {name}\n" for name in files))


def verify_digests(model_dir: Path) -> bool:
    """True when `model_dir` has SHA256SUMS and every file it lists has its digest (False: it has none);
    otherwise one line naming the first file that differs or is missing, and what to do."""
    listed = Path(model_dir) / DIGESTS
    if not listed.is_file():
        return False
    for line in listed.read_text().splitlines():
        digest, _, name = line.partition("  ")
        path = Path(model_dir) / name
        if not path.is_file():
            raise CourseError(f"{model_dir}: {name}, listed in {DIGESTS}, is missing; copy the model directory again")
        if sha256(path) != digest:
            raise CourseError(f"{path}: its SHA-256 is not the one {DIGESTS} lists: the file changed or was damaged "
                              f"after it was written; copy the model directory again")
    return True


def save_whole(model_dir: Path, state_dict: dict, sizes: dict, seq_len: int) -> None:
    """One process with the whole state dict: model.safetensors, config.json and SHA256SUMS into `model_dir`,
    written beside it first and moved into place whole (a reader never sees half of it)."""
    from safetensors.torch import save_file

    model_dir = Path(model_dir)
    partial = model_dir.with_name(model_dir.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)
    partial.mkdir(parents=True)
    save_file({k: v.contiguous() for k, v in state_dict.items()}, str(partial / "model.safetensors"),
              metadata={"format": "pt"})
    finish(partial, model_dir, sizes, seq_len)


def finish(partial: Path, model_dir: Path, sizes: dict, seq_len: int) -> None:
    """config.json and SHA256SUMS into `partial`, then `partial` moved to `model_dir` (an older one replaced)."""
    (partial / CONFIG).write_text(json.dumps(config_of(sizes, seq_len), indent=2) + "\n")
    write_digests(partial)
    shutil.rmtree(model_dir, ignore_errors=True)
    partial.rename(model_dir)
