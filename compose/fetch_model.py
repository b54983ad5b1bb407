"""Fetch a Hugging Face model's tokenizer and config files, never its weights, into a directory.

The one-shot ``model`` service of ``compose/docker-compose.gpu.yml`` runs it in the Kairos image
(``huggingface_hub`` comes with ``tokenizers``), so the dispatcher tokenizes prompts with the very
tokenizer the vLLM nodes serve:

    python fetch_model.py deepseek-ai/DeepSeek-V2-Lite /models/served [--revision REV]

The directory gets a marker naming the model and revision. A rerun for the same model keeps the
files and needs no network; another model empties the directory first, so no file of the old one
stays behind (a leftover ``chat_template.jinja`` would change how chat prompts are rendered).
``HF_TOKEN`` in the environment authenticates, for gated models.
"""

from __future__ import annotations

import argparse
import fnmatch
import shutil
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

# Tokenizer files (tokenizer.json, tokenizer_config.json, special_tokens_map.json, vocab and merges
# files), chat templates and config.json. Nothing that holds weights matches: see is_fetched.
ALLOW_PATTERNS = ("*.json", "*.jinja", "*.txt", "*.model", "*.tiktoken")
MARKER = ".kairos-model"
REQUIRED = "tokenizer.json"  # the dispatcher supports fast tokenizers only

Downloader = Callable[..., object]  # huggingface_hub.snapshot_download's signature


class FetchError(Exception):
    """The model's files could not be fetched (network, no tokenizer in the repository)."""


def is_fetched(filename: str) -> bool:
    """Whether a file of the model repository is fetched (its name, relative to the repository)."""
    return any(fnmatch.fnmatch(filename, pattern) for pattern in ALLOW_PATTERNS)


def marker_text(model: str, revision: str | None) -> str:
    return f"{model}@{revision or 'main'}\n"


def fetch(model: str, dest: Path, revision: str | None = None, download: Downloader | None = None) -> bool:
    """Put ``model``'s tokenizer and config files in ``dest``; False when they already were there."""
    marker = dest / MARKER
    wanted = marker_text(model, revision)
    if marker.is_file() and marker.read_text() == wanted and (dest / REQUIRED).is_file():
        return False
    if dest.exists():
        # Another model (or an interrupted fetch): empty the directory, keep it (it may be a mount).
        for child in dest.iterdir():
            if child.is_dir() and not child.is_symlink():
                shutil.rmtree(child)
            else:
                child.unlink()
    dest.mkdir(parents=True, exist_ok=True)
    if download is None:
        try:
            from huggingface_hub import snapshot_download
        except ImportError as exc:
            raise FetchError(f"huggingface_hub is not installed ({exc})") from exc
        download = snapshot_download
    try:
        download(repo_id=model, revision=revision, local_dir=str(dest), allow_patterns=list(ALLOW_PATTERNS))
    except Exception as exc:  # the hub's errors (auth, not found, network) all end the fetch
        raise FetchError(f"cannot fetch {model}: {type(exc).__name__}: {exc}") from exc
    if not (dest / REQUIRED).is_file():
        raise FetchError(f"{model} has no {REQUIRED}: the dispatcher needs a fast (tokenizers) tokenizer")
    marker.write_text(wanted)
    return True


def main(argv: Sequence[str] | None = None, download: Downloader | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model", help="Hugging Face repository id, e.g. deepseek-ai/DeepSeek-V2-Lite")
    parser.add_argument("dest", type=Path, help="directory to fill (the dispatcher's --model-dir)")
    parser.add_argument("--revision", default=None, help="branch, tag or commit (default: main)")
    args = parser.parse_args(argv)
    try:
        fetched = fetch(args.model, args.dest, args.revision, download)
    except FetchError as exc:
        print(f"fetch_model: {exc}", file=sys.stderr)
        return 1
    state = "fetched" if fetched else "already there"
    print(f"fetch_model: {args.model} tokenizer and config in {args.dest} ({state})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
