"""The packaged tiny models: generated files are what the script writes, the
geometry exercises the code paths of the models they stand for (docs/state-budget.md,
"The tiny models"), the files load the way SGLang loads them, and
`ServerConfig.model` names them."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from sglang_l3.testing import tiny_models
from sglang_l3.testing.server import (
    MODELS_DIR,
    PACKAGED_MODELS,
    ServerConfig,
    ServerError,
    model_dir,
    text_config,
)

DUMMY_KEY = "sglang_l3_dummy_init"


def _config(name: str) -> dict:
    return json.loads((MODELS_DIR / name / "config.json").read_text())


def test_packaged_files_are_what_the_generator_writes(tmp_path: Path) -> None:
    tiny_models.write_models(tmp_path)
    for name in ("tiny-qwen35", "tiny-qwen35-text"):
        assert tiny_models.differences(tmp_path / name, MODELS_DIR / name) == [], (
            f"{name}: run `python -m sglang_l3.testing.tiny_models` and commit the result"
        )


def test_packaged_models_stay_small() -> None:
    for name in PACKAGED_MODELS:
        size = sum(p.stat().st_size for p in (MODELS_DIR / name).rglob("*") if p.is_file())
        assert size < 100_000, (name, size)


@pytest.mark.parametrize("name", PACKAGED_MODELS)
def test_hybrid_geometry_like_the_real_models(name: str) -> None:
    t = text_config(name)
    n, interval = t["num_hidden_layers"], t["full_attention_interval"]
    full = [i for i in range(n) if (i + 1) % interval == 0]
    # SGLang takes the layer pattern from full_attention_interval (Qwen3NextConfig.layers_block_type)
    assert interval == 4 and full, t
    if "layer_types" in t:
        assert [i for i, x in enumerate(t["layer_types"]) if x == "full_attention"] == full
    for key in ("linear_num_key_heads", "linear_num_value_heads", "num_attention_heads", "num_key_value_heads"):
        assert t[key] % 2 == 0, f"{key} must split over TP=2"
    assert t[DUMMY_KEY] == "per-parameter-v1", "the dummy-init key must be where the model's `config` is"


def test_qwen35_ratios() -> None:
    mm, text = text_config("tiny-qwen35"), text_config("tiny-qwen35-text")
    # Qwen3.5-27B: 48 value / 16 key heads = 3 (torch fallback split off CUDA), 16 KV layers of 64
    assert mm["linear_num_value_heads"] // mm["linear_num_key_heads"] == 3
    assert mm["linear_key_head_dim"] == mm["linear_value_head_dim"]
    assert mm["num_hidden_layers"] // mm["full_attention_interval"] >= 2
    assert mm["attn_output_gate"] and mm["rope_parameters"]["mrope_interleaved"]
    # the text model takes the contiguous split kernel (ratios 1, 2, 4 off CUDA)
    assert text["linear_num_value_heads"] // text["linear_num_key_heads"] == 2
    top = _config("tiny-qwen35")
    assert DUMMY_KEY not in top, "a multimodal model's `config` is its text_config: the key belongs there"
    assert top["architectures"] == ["Qwen3_5ForConditionalGeneration"]
    assert _config("tiny-qwen35-text")["architectures"] == ["Qwen3_5ForCausalLM"]


def test_sglang_reads_the_dummy_key_from_the_text_config() -> None:
    from sglang.srt.utils.hf_transformers_utils import get_config

    cfg = get_config(str(MODELS_DIR / "tiny-qwen35"), trust_remote_code=False)
    assert getattr(cfg.get_text_config(), DUMMY_KEY, None) == "per-parameter-v1"
    assert cfg.text_config.linear_num_value_heads == 6


def test_tokenizer_and_processor_load_with_qwen_ids() -> None:
    from transformers import AutoProcessor, AutoTokenizer

    mm = MODELS_DIR / "tiny-qwen35"
    tok = AutoTokenizer.from_pretrained(str(mm))
    assert type(tok).__name__ == "Qwen3_5Tokenizer"
    cfg = _config("tiny-qwen35")
    assert tok.convert_tokens_to_ids("<|image_pad|>") == cfg["image_token_id"]
    assert tok.convert_tokens_to_ids("<|vision_start|>") == cfg["vision_start_token_id"]
    assert len(tok) == text_config("tiny-qwen35")["vocab_size"]
    assert tok.eos_token_id == text_config("tiny-qwen35")["eos_token_id"]
    msgs = [
        {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}, {"type": "text", "text": "hi"}]},
        {"role": "assistant", "content": "ok"},
        {"role": "user", "content": "more"},
    ]
    two = tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
    one = tok.apply_chat_template(msgs[:1], tokenize=False, add_generation_prompt=True)
    assert "<|vision_start|><|image_pad|><|vision_end|>" in one and one.endswith("<|im_start|>assistant\n<think>\n")
    # an earlier turn renders identically later, up to the generation prompt's `<think>`
    assert two.startswith(one.removesuffix("<think>\n")), (one, two)
    proc = AutoProcessor.from_pretrained(str(mm))
    assert type(proc).__name__ == "Qwen3VLProcessor"
    assert proc.image_processor.merge_size == 2 and proc.image_processor.patch_size == 16


def test_server_config_model_field(tmp_path: Path) -> None:
    assert ServerConfig().model == "tiny-qwen3next"
    for name in PACKAGED_MODELS:
        args = ServerConfig(model=name).args(1234)
        assert args[args.index("--model-path") + 1] == str(MODELS_DIR / name)
    (tmp_path / "config.json").write_text(json.dumps(_config("tiny-qwen35-text")))
    args = ServerConfig(model=str(tmp_path)).args(1234)
    assert args[args.index("--model-path") + 1] == str(tmp_path.resolve())
    assert "--skip-tokenizer-init" in args
    assert "--skip-tokenizer-init" not in ServerConfig(skip_tokenizer_init=False).args(1234)
    with pytest.raises(ServerError, match="neither a packaged model"):
        model_dir(tmp_path / "nothing-here")


def _restore_bench():
    import importlib.util
    import sys

    path = Path(__file__).resolve().parents[2] / "benchmark" / "restore_bench.py"
    spec = importlib.util.spec_from_file_location("restore_bench", path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules.setdefault("restore_bench", mod)
    spec.loader.exec_module(mod)
    return mod


def test_tiny_qwen35_takes_the_27b_code_paths() -> None:
    """docs/state-budget.md "The tiny models": against benchmark/restore_bench.py's
    Qwen3.5-27B row (the one place the real geometry lives)."""
    rb = _restore_bench()
    big = next(m for m in rb.MODELS if m.name == "Qwen3.5-27B")
    tiny = rb.ModelShape.from_config("tiny-qwen35", text_config("tiny-qwen35"))
    assert tiny.full_attention_interval == big.full_attention_interval
    assert len(tiny.full_layers) >= 2 and tiny.num_hidden_layers - len(tiny.full_layers) >= 2
    assert (
        tiny.linear_num_value_heads * big.linear_num_key_heads == big.linear_num_value_heads * tiny.linear_num_key_heads
    )
    assert (tiny.linear_key_head_dim == tiny.linear_value_head_dim) == (
        big.linear_key_head_dim == big.linear_value_head_dim
    )
    assert tiny.linear_conv_kernel_dim == big.linear_conv_kernel_dim
    for tp in (1, 2):  # the ratio per rank survives TP=2, as the 27B's 8 / 24
        assert (tiny.linear_num_value_heads // tp) // (tiny.linear_num_key_heads // tp) == 3
        assert tiny.conv_dim(tp) * tp == 2 * 2 * 32 + 6 * 32
    assert tiny.state_bytes(2) == 79_488 and tiny.kv_bytes_per_token(2) == 512  # the docs' table
    assert big.state_bytes(2) == 76_972_032 and big.kv_bytes_per_token(2) == 32_768


def test_chat_template_is_the_real_qwen35_one() -> None:
    """Both models carry the template the Qwen3.5 checkpoints ship (vendored, sha256
    pinned), and it renders what the real model sees: thinking, XML tool calls,
    tool results in a user turn, history thinking dropped before the last query."""
    from transformers import AutoTokenizer

    want = tiny_models.chat_template()
    for name in ("tiny-qwen35", "tiny-qwen35-text"):
        assert (MODELS_DIR / name / "chat_template.jinja").read_text() == want, name
    tok = AutoTokenizer.from_pretrained(str(MODELS_DIR / "tiny-qwen35-text"))
    tools = [{"type": "function", "function": {"name": "read_file", "parameters": {"type": "object"}}}]
    call = {"id": "c1", "type": "function", "function": {"name": "read_file", "arguments": {"path": "a.txt"}}}
    msgs = [
        {"role": "system", "content": "sys"},
        {"role": "user", "content": "q1"},
        {"role": "assistant", "content": "", "reasoning_content": "r1", "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "c1", "content": "text"},
    ]
    live = tok.apply_chat_template(msgs, tools=tools, tokenize=False, add_generation_prompt=True)
    assert live.startswith("<|im_start|>system\n# Tools\n\nYou have access to the following functions:\n\n<tools>\n")
    assert "</IMPORTANT>\n\nsys<|im_end|>\n" in live
    assert (
        "<|im_start|>assistant\n<think>\nr1\n</think>\n\n<tool_call>\n<function=read_file>\n"
        "<parameter=path>\na.txt\n</parameter>\n</function>\n</tool_call><|im_end|>\n"
        "<|im_start|>user\n<tool_response>\ntext\n</tool_response><|im_end|>\n<|im_start|>assistant\n<think>\n"
    ) in live
    # after the next user query the same assistant turn loses its thinking (the real
    # template's rule: what a prefix cache can reuse across turns)
    later = tok.apply_chat_template(msgs + [{"role": "user", "content": "q2"}], tools=tools, tokenize=False)
    assert "<|im_start|>assistant\n<tool_call>\n<function=read_file>" in later and "r1" not in later
    ids = tok(live)["input_ids"]
    for special in ("<tool_call>", "</tool_call>", "<think>", "<tool_response>"):
        assert tok.convert_tokens_to_ids(special) in ids, special


def test_a_changed_template_is_refused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    fake = tmp_path / "t.jinja"
    fake.write_text(tiny_models.chat_template() + " ")
    monkeypatch.setattr(tiny_models, "CHAT_TEMPLATE_FILE", fake)
    with pytest.raises(RuntimeError, match="sha256"):
        tiny_models.chat_template()
