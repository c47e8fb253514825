"""Engine flags shared by `generate`, `compile` and `serve`, in vLLM's spelling and meaning.

Flags vLLM has that cannot change anything here are accepted, and each warns once at start-up
saying why (`warn_inapplicable`): a pasted vLLM command line runs, and says what it did not do.
"""

from __future__ import annotations

import argparse
import json
import logging

from compilelm.config import EngineConfig

logger = logging.getLogger("compilelm")


def add_engine_args(parser: argparse.ArgumentParser, model_positional: bool = True) -> None:
    if model_positional:
        parser.add_argument("model_tag", nargs="?", default=None, metavar="MODEL",
                            help="HF directory, Hugging Face repo id, .gguf file, or dummy:<preset> "
                                 "(default: SmolLM2-135M-Instruct)")
    parser.add_argument("--model", default=None, help="same as the positional MODEL")
    parser.add_argument("--config", metavar="FILE.yaml", default=None,
                        help="flags from a YAML file (`max-model-len: 4096`); the command line's win")
    m = parser.add_argument_group("model")
    m.add_argument("--revision", default=None, help="a Hugging Face repo id's branch, tag or commit (default: main)")
    m.add_argument("--download-dir", default=None,
                   help="the Hugging Face cache to read and download into (default: $HF_HOME/hub)")
    m.add_argument("--tokenizer", default=None, help="tokenizer folder, .gguf file or repo id (default: the model's)")
    m.add_argument("--tokenizer-revision", default=None, help="the --tokenizer repo's revision (default: --revision)")
    m.add_argument("--chat-template", default=None,
                   help="a chat template file, or the template itself, replacing the tokenizer's")
    m.add_argument("--generation-config", default="auto",
                   help="default sampling: auto (the model's generation_config.json), vllm (none), or a "
                        "folder holding a generation_config.json")
    m.add_argument("--override-generation-config", default=None, metavar="JSON",
                   help='default sampling laid over --generation-config, e.g. \'{"temperature": 0.5}\'')
    m.add_argument("--trust-remote-code", action="store_true",
                   help="accepted for vLLM command lines; compilelm never runs a model's own code")
    g = parser.add_argument_group("engine")
    g.add_argument("--dtype", default="auto",
                   help="auto (the checkpoint's torch_dtype on GPU, float32 checkpoints in bfloat16; float32 "
                        "on CPU) | float32 | bfloat16 | float16")
    g.add_argument("--device", default="auto", help="auto | cpu | cuda")
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--max-model-len", type=human_int, default=None, help="e.g. 4096, 32k (32000), 32K (32768)")
    g.add_argument("--max-num-seqs", type=int, default=None,
                   help="sequences a step may hold (default: as vLLM, 1024 on GPUs of 70+ GiB, else 256)")
    g.add_argument("--max-num-batched-tokens", type=human_int, default=None,
                   help="tokens a step may hold (default: as vLLM, on GPUs of 70+ GiB 8192 for serve and 16384 "
                        "for LLM / generate, on smaller GPUs 2048 / 8192, on the CPU 2048)")
    g.add_argument("--block-size", type=int, default=16)
    g.add_argument("--num-kv-blocks", type=int, default=None, help="fixed KV-cache size in blocks")
    g.add_argument("--kv-cache-memory-gb", type=float, default=2.0, help="KV-cache budget on CPU")
    g.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    g.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=True,
                   help="reuse the KV cache of shared prompt prefixes (default: on)")
    g.add_argument("--enable-chunked-prefill", action=argparse.BooleanOptionalAction, default=None,
                   help="split long prompts over several steps (default: on)")
    g.add_argument("--kv-cache-dtype", default="auto", choices=["auto", "fp8", "fp8_e4m3", "fp8_e5m2"],
                   help="auto (the model's dtype) | fp8 = fp8_e4m3 (float8_e4m3fn, per-layer k/v scales from the "
                        "checkpoint, else 1.0: twice the tokens in the same memory); fp8_e5m2 is refused")
    g.add_argument("--disable-log-stats", action="store_true", help="serve: no periodic stats line")
    g.add_argument("--async-scheduling", action=argparse.BooleanOptionalAction, default=None,
                   help="schedule step N+1 while the GPU runs step N (default: on for CUDA)")
    g.add_argument("--tensor-parallel-size", "-tp", type=int, default=1,
                   help="split the model over N ranks, one process each (gloo on CPU, NCCL on GPU)")
    g.add_argument("--custom-all-reduce-min-bytes", type=int, default=None, metavar="BYTES",
                   help="TP on CUDA: all-reduces from this size take the one-shot peer-memory kernel, smaller "
                        "ones NCCL (default 1 MiB; 0 = every size it takes; -1 = NCCL only)")
    g.add_argument("--quantization", "-q", default=None, choices=["fp8"],
                   help="fp8: W8A8 linears (fp8 weights, per-token fp8 activations); FP8 checkpoints "
                        "(fp8, compressed-tensors) are detected from config.json without it")
    c = parser.add_argument_group("compilation")
    c.add_argument("-O", "--optimization-level", dest="optimization_level", type=int, default=None,
                   choices=[0, 1, 2, 3], help="0 eager, 1 piecewise compile, 2 default (all passes), 3 + static sizes")
    c.add_argument("--enforce-eager", action="store_true", help="never compile (same as -O0)")
    c.add_argument("--compilation-config", "-cc", default=None, help="JSON overriding CompileConfig fields")
    c.add_argument("--no-compile-cache", action="store_true", help="do not read or write the compile cache")
    c.add_argument("--pass", dest="custom_passes", action="append", default=[],
                   metavar="MODULE:CLASS[,stage=S][,before=P|after=P]",
                   help="add a custom graph pass (repeatable; after the built-in passes of its stage by default)")


_SUFFIXES = {"k": 10**3, "m": 10**6, "g": 10**9, "K": 2**10, "M": 2**20, "G": 2**30}


def human_int(text: str) -> int:
    """vLLM's token counts: 4096, 32k = 32000, 25.6k = 25600, 32K = 32768 (no decimals with K/M/G)."""
    text = text.strip()
    if text[-1:] in _SUFFIXES:
        number, mult = text[:-1], _SUFFIXES[text[-1]]
        if text[-1].isupper():
            if not number.isdigit():
                raise argparse.ArgumentTypeError(f"{text!r}: no decimals with binary suffixes (K, M, G)")
            return int(number) * mult
        try:
            return int(float(number) * mult)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number (e.g. 4096, 32k, 32K)") from None


class ArgError(ValueError):
    """A bad flag value; the message names the flag."""


def warn_inapplicable(args: argparse.Namespace) -> None:
    """One warning per vLLM flag given that has nothing to change here, saying why."""
    if getattr(args, "trust_remote_code", False):
        logger.warning("--trust-remote-code: ignored; compilelm runs only its built-in architectures "
                       "(Llama, Mistral, Qwen2, Qwen3) and never executes a checkpoint's own code")
    if getattr(args, "disable_log_requests", False):
        logger.warning("--disable-log-requests: requests are not logged by default (as in vLLM, which "
                       "deprecated this flag); --enable-log-requests turns logging on")


def _json_object(flag: str, text: str | None) -> dict:
    if text is None:
        return {}
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise ArgError(f"{flag}: not valid JSON: {e}") from e
    if not isinstance(value, dict):
        raise ArgError(f"{flag}: must be a JSON object, got {text!r}")
    return value


def engine_config_from_args(args: argparse.Namespace, usage_context: str = "llm_class") -> EngineConfig:
    """`usage_context`: "openai_api_server" for `serve` (a smaller default step budget, as vLLM's)."""
    from compilelm.llm import make_engine_config
    from compilelm.models.generation_config import SAMPLING_KEYS
    from compilelm.models.tokenizer import load_chat_template

    warn_inapplicable(args)
    model = args.model or getattr(args, "model_tag", None)
    try:
        load_chat_template(args.chat_template)  # a missing file fails now, naming the flag
    except OSError as e:
        raise ArgError(f"--chat-template: {e}") from e
    if args.generation_config not in ("auto", "vllm"):
        import os
        if not os.path.isfile(os.path.join(args.generation_config, "generation_config.json")):
            raise ArgError(f"--generation-config: no generation_config.json in {args.generation_config} "
                           "(auto | vllm | a folder holding one)")
    override = _json_object("--override-generation-config", args.override_generation_config)
    unknown = sorted(set(override) - set(SAMPLING_KEYS))
    if unknown:
        raise ArgError(f"--override-generation-config: unknown key(s) {', '.join(unknown)}; known: "
                       f"{', '.join(SAMPLING_KEYS)}")
    kw = dict(revision=args.revision, download_dir=args.download_dir, tokenizer=args.tokenizer,
              tokenizer_revision=args.tokenizer_revision, chat_template=args.chat_template,
              generation_config=args.generation_config, override_generation_config=tuple(override.items()),
              dtype=args.dtype, device=args.device, seed=args.seed, max_model_len=args.max_model_len,
              block_size=args.block_size, num_kv_blocks=args.num_kv_blocks,
              kv_cache_memory_gb=args.kv_cache_memory_gb, kv_cache_dtype=getattr(args, "kv_cache_dtype", "auto"),
              gpu_memory_utilization=args.gpu_memory_utilization,
              enable_prefix_caching=args.enable_prefix_caching, quantization=args.quantization,
              tensor_parallel_size=args.tensor_parallel_size, usage_context=usage_context,
              custom_all_reduce_min_bytes=getattr(args, "custom_all_reduce_min_bytes", None))
    if args.max_num_seqs is not None:
        kw["max_num_seqs"] = args.max_num_seqs
    if args.max_num_batched_tokens is not None:
        kw["max_num_batched_tokens"] = args.max_num_batched_tokens
    if args.enable_chunked_prefill is not None:
        kw["enable_chunked_prefill"] = args.enable_chunked_prefill
    if getattr(args, "async_scheduling", None) is not None:
        kw["async_scheduling"] = args.async_scheduling
    compilation = args.compilation_config
    if args.no_compile_cache:
        import json
        compilation = json.dumps({**json.loads(compilation or "{}"), "use_cache": False})
    if getattr(args, "custom_passes", None):
        import json
        given = json.loads(compilation or "{}")
        compilation = json.dumps({**given, "custom_passes": [*given.get("custom_passes", []), *args.custom_passes]})
    flag_of = {"dtype": "--dtype", "device": "--device", "max_model_len": "--max-model-len",
               "block_size": "--block-size", "num_kv_blocks": "--num-kv-blocks",
               "max_num_seqs": "--max-num-seqs", "max_num_batched_tokens": "--max-num-batched-tokens",
               "gpu_memory_utilization": "--gpu-memory-utilization",
               "kv_cache_memory_gb": "--kv-cache-memory-gb", "kv_cache_dtype": "--kv-cache-dtype",
               "quantization": "--quantization",
               "tensor_parallel_size": "--tensor-parallel-size",
               "custom_all_reduce_min_bytes": "--custom-all-reduce-min-bytes",
               "generation_config": "--generation-config", "enable_chunked_prefill": "--enable-chunked-prefill"}
    try:
        return make_engine_config(model, compilation_config=compilation, enforce_eager=args.enforce_eager,
                                  optimization_level=args.optimization_level, **kw)
    except ValueError as e:
        msg = str(e)
        for field, flag in flag_of.items():
            if msg.startswith(field) or f" {field} " in msg:
                raise ArgError(f"{flag}: {msg}") from e
        if "compil" in msg.lower() or "field" in msg.lower():
            raise ArgError(f"--compilation-config: {msg}") from e
        raise ArgError(msg) from e
