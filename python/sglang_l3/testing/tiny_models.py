"""Generate the packaged tiny Qwen3.5 models (python/sglang_l3/models/tiny-qwen35,
tiny-qwen35-text): config, tokenizer with Qwen3.5's chat template, and (for the
multimodal one) the image and video processor configs. The chat template is the one the
real Qwen3.5 checkpoints ship (`chat_template()`, vendored verbatim, Apache-2.0).

    python -m sglang_l3.testing.tiny_models           # (re)write the packaged files
    python -m sglang_l3.testing.tiny_models --check   # exit 1 when they differ from what this writes
    python -m sglang_l3.testing.tiny_models --out DIR # write elsewhere

Weights are never written: the models are served with `--load-format dummy` and
`sglang_l3_dummy_init` (patch tiny-model-dummy-weights) in the config the model's
`config` attribute holds — for `Qwen3_5ForConditionalGeneration` that is the
`text_config` (sglang.srt.models.qwen3_vl sets `self.config = config.text_config`).

Geometry (docs/state-budget.md, "The tiny models"): Qwen3.5-27B's ratios at toy sizes.
- tiny-qwen35 (`Qwen3_5ForConditionalGeneration`, the user's architecture): 8 layers
  from `full_attention_interval` 4 (3 Gated-DeltaNet + 1 full attention, twice: two
  KV layers, as the 27B's 16), value heads / key heads = 6 / 2 = 3 as the 27B's 48 / 16
  (so the GDN input split takes upstream's torch fallback, as on the user's ROCm
  GPUs), equal key/value head dims, 6 query heads over 2 KV heads, attention output
  gate, partial rotary 0.25 with interleaved M-RoPE; a 2-block vision tower.
- tiny-qwen35-text (`Qwen3_5ForCausalLM`): the same text backbone at 4 layers with
  value heads / key heads = 4 / 2 = 2 (Qwen3.5-9B's 32 / 16), which takes the
  contiguous split kernel (ported by patch cpu-qwen35-ops).
Both stay TP=2-divisible (every head count even).

Tokenizer: byte-level BPE trained on this repository's LICENSE (Apache-2.0 text,
stable) to 1024 ids, then Qwen's special tokens at 1024-1049 (same order as Qwen3's
151643-151668), so the test prompts (`sglang_l3.testing.server.prompt`: ids 3-1002)
never contain one. The class is `Qwen3_5Tokenizer`, which transformers 5 uses for
model_type qwen3_5 whatever tokenizer_config.json says.
"""

from __future__ import annotations

import argparse
import filecmp
import hashlib
import json
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Any

import sglang_l3

MODELS_DIR = Path(sglang_l3.__file__).resolve().parent / "models"
LICENSE = Path(sglang_l3.__file__).resolve().parents[2] / "LICENSE"
DUMMY_INIT = {"sglang_l3_dummy_init": "per-parameter-v1"}  # sglang_l3.cpu_serving.weights

BPE_SIZE = 1024
SPECIAL_TOKENS = [  # (token, special): Qwen3's order, ids BPE_SIZE.. upwards
    ("<|endoftext|>", True),
    ("<|im_start|>", True),
    ("<|im_end|>", True),
    ("<|object_ref_start|>", True),
    ("<|object_ref_end|>", True),
    ("<|box_start|>", True),
    ("<|box_end|>", True),
    ("<|quad_start|>", True),
    ("<|quad_end|>", True),
    ("<|vision_start|>", True),
    ("<|vision_end|>", True),
    ("<|vision_pad|>", True),
    ("<|image_pad|>", True),
    ("<|video_pad|>", True),
    ("<tool_call>", False),
    ("</tool_call>", False),
    ("<|fim_prefix|>", False),
    ("<|fim_middle|>", False),
    ("<|fim_suffix|>", False),
    ("<|fim_pad|>", False),
    ("<|repo_name|>", False),
    ("<|file_sep|>", False),
    ("<tool_response>", False),
    ("</tool_response>", False),
    ("<think>", False),
    ("</think>", False),
]
TOKEN_ID = {tok: BPE_SIZE + i for i, (tok, _) in enumerate(SPECIAL_TOKENS)}
VOCAB_SIZE = BPE_SIZE + len(SPECIAL_TOKENS)  # 1050: every id decodes to a token

# Qwen's pre-tokenizer (transformers' Qwen3_5Tokenizer.PRETOKENIZE_REGEX)
PRETOKENIZE_REGEX = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*"""
    r"""|\s*[\r\n]+|\s+(?!\S)|\s+"""
)

# The chat template the real Qwen3.5 checkpoints ship (Qwen/Qwen3.5-*
# chat_template.jinja, Apache-2.0 like the models): thinking (`<think>` opened by the
# generation prompt), Qwen3-Coder XML tool calls (`<tool_call><function=…><parameter=…>`),
# tool results as `<tool_response>` in a user turn. Vendored verbatim: copied from
# ikawrakow/ik_llama.cpp's models/templates/Qwen3.5-4B.jinja as of its commit
# e0596bf6146a737f5e8fa8035215f5dfae59742d (#1376, taken from the Qwen3.5-4B
# checkpoint); its sha256 is checked here so an edit cannot pass for the real one.
CHAT_TEMPLATE_FILE = Path(__file__).resolve().parent / "templates" / "qwen3_5_chat_template.jinja"
CHAT_TEMPLATE_SHA256 = "a4aee8afcf2e0711942cf848899be66016f8d14a889ff9ede07bca099c28f715"


def chat_template() -> str:
    """The vendored Qwen3.5 template; a file whose sha256 differs is refused."""
    data = CHAT_TEMPLATE_FILE.read_bytes()
    got = hashlib.sha256(data).hexdigest()
    if got != CHAT_TEMPLATE_SHA256:
        raise RuntimeError(
            f"{CHAT_TEMPLATE_FILE}: sha256 {got}, want {CHAT_TEMPLATE_SHA256} (the real Qwen3.5 template)"
        )
    return data.decode()


def text_config(*, layers: int, key_heads: int, value_heads: int) -> dict[str, Any]:
    """A Qwen3.5 text backbone (`qwen3_5_text`) at toy sizes; the 27B's values in comments."""
    interval = 4  # 27B: 4 (64 layers = 16 x (3 GDN + 1 full))
    return {
        "model_type": "qwen3_5_text",
        "attention_bias": False,
        "attention_dropout": 0.0,
        "attn_output_gate": True,  # 27B: true (gated attention output)
        "bos_token_id": None,
        "eos_token_id": TOKEN_ID["<|im_end|>"],
        "pad_token_id": None,
        "full_attention_interval": interval,
        "head_dim": 64,  # 27B: 256 (rotary 64 = 0.25 x 256; here 16)
        "hidden_act": "silu",
        "hidden_size": 128,  # 27B: 5120
        "initializer_range": 0.02,
        "intermediate_size": 256,  # 27B: 17408 (dense MLP, no MoE)
        "layer_types": ["full_attention" if (i + 1) % interval == 0 else "linear_attention" for i in range(layers)],
        "linear_conv_kernel_dim": 4,  # 27B: 4
        "linear_key_head_dim": 32,  # 27B: 128 (= value head dim)
        "linear_num_key_heads": key_heads,  # 27B: 16
        "linear_num_value_heads": value_heads,  # 27B: 48
        "linear_value_head_dim": 32,  # 27B: 128
        "mamba_ssm_dtype": "float32",  # 27B: float32 temporal state
        "max_position_embeddings": 8192,
        "num_attention_heads": 6,  # 27B: 24 over 4 KV heads
        "num_hidden_layers": layers,
        "num_key_value_heads": 2,
        "rms_norm_eps": 1e-06,
        "rope_parameters": {  # 27B: mrope_section [11, 11, 10] of 32 rotary pairs; here 8
            "mrope_interleaved": True,
            "mrope_section": [3, 3, 2],
            "partial_rotary_factor": 0.25,
            "rope_theta": 10000000,
            "rope_type": "default",
        },
        "tie_word_embeddings": False,
        "use_cache": True,
        "vocab_size": VOCAB_SIZE,
        **DUMMY_INIT,
    }


def multimodal_config() -> dict[str, Any]:
    text = text_config(layers=8, key_heads=2, value_heads=6)
    return {
        "architectures": ["Qwen3_5ForConditionalGeneration"],
        "model_type": "qwen3_5",
        "image_token_id": TOKEN_ID["<|image_pad|>"],
        "video_token_id": TOKEN_ID["<|video_pad|>"],
        "vision_start_token_id": TOKEN_ID["<|vision_start|>"],
        "vision_end_token_id": TOKEN_ID["<|vision_end|>"],
        "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
        "text_config": text,
        "vision_config": {  # 27B: depth 27, hidden 1152, 16 heads, same patching
            "model_type": "qwen3_5",
            "deepstack_visual_indexes": [],
            "depth": 2,
            "hidden_act": "gelu_pytorch_tanh",
            "hidden_size": 64,
            "in_channels": 3,
            "initializer_range": 0.02,
            "intermediate_size": 128,
            "num_heads": 2,
            "num_position_embeddings": 2304,
            "out_hidden_size": text["hidden_size"],
            "patch_size": 16,
            "spatial_merge_size": 2,
            "temporal_patch_size": 2,
        },
    }


def causal_lm_config() -> dict[str, Any]:
    return {
        "architectures": ["Qwen3_5ForCausalLM"],
        "torch_dtype": "bfloat16",
        **text_config(layers=4, key_heads=2, value_heads=4),
    }


# images: 32 px (one merged 2x2 patch) per token side; small images stay small
IMAGE_SIZE = {"shortest_edge": 32 * 32, "longest_edge": 512 * 512}
VIDEO_SIZE = {"shortest_edge": 32 * 32 * 4, "longest_edge": 256 * 256 * 8}


def _tokenizer(license_text: str):
    from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
    from transformers.models.qwen3_5.tokenization_qwen3_5 import Qwen3_5Tokenizer

    tok = Tokenizer(models.BPE())
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(PRETOKENIZE_REGEX), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=BPE_SIZE, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False
    )
    tok.train_from_iterator([license_text], trainer)
    model = json.loads(tok.to_str())["model"]
    vocab, merges = model["vocab"], [tuple(m) if isinstance(m, list) else tuple(m.split(" ")) for m in model["merges"]]
    if len(vocab) != BPE_SIZE:
        raise RuntimeError(f"BPE vocabulary has {len(vocab)} tokens, want {BPE_SIZE}")
    from tokenizers import AddedToken

    hf = Qwen3_5Tokenizer(
        vocab=vocab,
        merges=merges,
        unk_token=None,
        eos_token=None,
        pad_token=None,
        errors="replace",
        model_max_length=8192,
    )
    # the specials first, at their ids; then name eos / pad among them
    hf.add_tokens([AddedToken(t, special=s, normalized=False) for t, s in SPECIAL_TOKENS])
    hf.eos_token = "<|im_end|>"
    hf.pad_token = "<|endoftext|>"
    hf.chat_template = chat_template()
    for tok_str, want in TOKEN_ID.items():
        got = hf.convert_tokens_to_ids(tok_str)
        if got != want:
            raise RuntimeError(f"{tok_str} got id {got}, want {want}")
    return hf


def _write_json(path: Path, obj: dict[str, Any]) -> None:
    path.write_text(json.dumps(obj, indent=2, sort_keys=False) + "\n")


def _save_tokenizer(hf: Any, out: Path) -> None:
    hf.save_pretrained(str(out))
    for name in ("special_tokens_map.json", "added_tokens.json"):
        (out / name).unlink(missing_ok=True)  # redundant with tokenizer.json / tokenizer_config.json


def write_models(root: Path) -> list[Path]:
    """Write both model directories under `root`; returns them."""
    from transformers.models.qwen2_vl.image_processing_qwen2_vl import Qwen2VLImageProcessor
    from transformers.models.qwen3_vl.video_processing_qwen3_vl import Qwen3VLVideoProcessor

    hf = _tokenizer(LICENSE.read_text())
    mm, text = root / "tiny-qwen35", root / "tiny-qwen35-text"
    for d in (mm, text):
        if d.exists():
            shutil.rmtree(d)
        d.mkdir(parents=True)

    _write_json(mm / "config.json", multimodal_config())
    _save_tokenizer(hf, mm)
    common = {"patch_size": 16, "temporal_patch_size": 2, "merge_size": 2, "image_mean": [0.5] * 3}
    common["image_std"] = [0.5] * 3
    Qwen2VLImageProcessor(size=dict(IMAGE_SIZE), **common).save_pretrained(str(mm))
    Qwen3VLVideoProcessor(size=dict(VIDEO_SIZE), fps=2, min_frames=4, max_frames=64, **common).save_pretrained(str(mm))
    _add_processor_class(mm)

    _write_json(text / "config.json", causal_lm_config())
    _save_tokenizer(hf, text)
    return [mm, text]


def _add_processor_class(d: Path) -> None:
    """AutoProcessor reads the processor class from tokenizer_config.json / processor_config.json."""
    cfg = d / "tokenizer_config.json"
    obj = json.loads(cfg.read_text())
    obj["processor_class"] = "Qwen3VLProcessor"
    _write_json(cfg, obj)
    for name in ("preprocessor_config.json", "video_preprocessor_config.json"):
        p = d / name
        o = json.loads(p.read_text())
        o["processor_class"] = "Qwen3VLProcessor"
        _write_json(p, o)


def differences(a: Path, b: Path) -> list[str]:
    """Files that differ between two model trees (names relative to them)."""
    out = []
    names = {p.relative_to(a) for p in a.rglob("*") if p.is_file()} | {
        p.relative_to(b) for p in b.rglob("*") if p.is_file()
    }
    for n in sorted(names):
        pa, pb = a / n, b / n
        if not (pa.is_file() and pb.is_file() and filecmp.cmp(pa, pb, shallow=False)):
            out.append(str(n))
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--check", action="store_true", help="compare the packaged files with a fresh generation")
    ap.add_argument("--out", type=Path, default=MODELS_DIR)
    args = ap.parse_args(argv)
    if not args.check:
        for d in write_models(args.out):
            print(f"wrote {d}")
        return 0
    with tempfile.TemporaryDirectory() as tmp:
        fresh = Path(tmp)
        write_models(fresh)
        bad = []
        for name in ("tiny-qwen35", "tiny-qwen35-text"):
            bad += [f"{name}/{f}" for f in differences(fresh / name, args.out / name)]
    for f in bad:
        print(f"differs: {f}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
