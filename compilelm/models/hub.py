"""A Hugging Face repo id -> a local snapshot folder, through `huggingface_hub` (as vLLM resolves one).

The cache is huggingface_hub's (`HF_HUB_CACHE`, else `$HF_HOME/hub`, else
`~/.cache/huggingface/hub`), or `--download-dir`. With `HF_HUB_OFFLINE=1` only the cache is
read; otherwise missing files are downloaded: the config, tokenizer and index files first, then
only the weight files the checkpoint needs (those named by `model.safetensors.index.json`, else
every `*.safetensors` but Mistral's `consolidated*.safetensors`, the same weights again under
other names). Every failure is a FileNotFoundError that names the repo, the revision and the cache.
"""

from __future__ import annotations

import json
import os
import re

# what a repo id looks like: "name" or "owner/name" (huggingface_hub's own rule, without its import)
_REPO_ID = re.compile(r"[A-Za-z0-9][\w.-]*(/[\w.-]+)?")
_TRUE = ("1", "ON", "YES", "TRUE")
CONFIG_PATTERNS = ["*.json", "*.jinja", "additional_chat_templates/*", "tokenizer.model", "*.tiktoken",
                   "merges.txt", "vocab.txt"]


def looks_like_repo_id(spec: str) -> bool:
    """`Qwen/Qwen3-8B` is a repo id; `/models/x`, `./x`, `~/x`, `x.gguf` are paths."""
    return (bool(_REPO_ID.fullmatch(spec)) and not spec.endswith(".gguf")
            and ".." not in spec and not spec.startswith("."))


def hub_cache_dir(download_dir: str | None = None) -> str:
    """Where huggingface_hub keeps (or would keep) its snapshots, read now (not at import)."""
    if download_dir:
        return download_dir
    if os.environ.get("HF_HUB_CACHE"):
        return os.environ["HF_HUB_CACHE"]
    home = os.environ.get("HF_HOME") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache"), "huggingface")
    return os.path.join(home, "hub")


def hub_offline() -> bool:
    from huggingface_hub import constants
    return os.environ.get("HF_HUB_OFFLINE", "").upper() in _TRUE or bool(constants.HF_HUB_OFFLINE)


def snapshot(repo_id: str, revision: str | None = None, download_dir: str | None = None,
             weights: bool = True) -> str:
    """The local snapshot folder of `repo_id` at `revision` (default: main), downloaded where
    needed and allowed. `weights=False` fetches only config and tokenizer files (--tokenizer)."""
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import HFValidationError

    cache, offline = hub_cache_dir(download_dir), hub_offline()
    where = f"{repo_id!r} (revision {revision or 'main'})"

    def fetch(**patterns) -> str:
        try:
            return snapshot_download(repo_id, revision=revision, cache_dir=cache, local_files_only=offline,
                                     **patterns)
        except HFValidationError as e:
            raise FileNotFoundError(f"model path does not exist and {repo_id!r} is not a Hugging Face "
                                    f"repo id: {e}") from e
        except Exception as e:  # noqa: BLE001 - every hub failure (no network, 404, gated) gets one message
            how = ("HF_HUB_OFFLINE is set, so nothing is downloaded" if offline
                   else f"downloading failed: {type(e).__name__}: {e}")
            raise FileNotFoundError(
                f"model {where} is not a local path and is not in the Hugging Face cache {cache}; {how}. "
                "Download it first (`huggingface-cli download "
                f"{repo_id}`), point HF_HOME / --download-dir at the cache that has it, or pass a "
                "local folder") from e

    path = fetch(allow_patterns=CONFIG_PATTERNS)
    if weights and not offline:
        index = os.path.join(path, "model.safetensors.index.json")
        if os.path.isfile(index):
            with open(index) as f:
                path = fetch(allow_patterns=sorted(set(json.load(f)["weight_map"].values())))
        else:
            path = fetch(allow_patterns=["*.safetensors"], ignore_patterns=["consolidated*.safetensors"])
    return path
