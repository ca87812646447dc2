"""Patch gptq-rocm on a simulated HIP platform: registry, allowlist, Marlin, and the
ROCm GPTQ config/scheme driven through upstream's own classes on CPU.

HIP is simulated by patching upstream's predicates (sglang.srt.utils.is_hip, the
copy model_config imported, Marlin's capability probe -> (11, 0) as gfx1100
reports) for the duration of a test only."""

from __future__ import annotations

import copy
from fractions import Fraction
from types import SimpleNamespace

import pytest
import sglang.srt.configs.model_config as model_config
import sglang.srt.layers.quantization as quant
import sglang.srt.layers.quantization.marlin_utils as marlin_utils
import sglang.srt.utils as sgl_utils
import torch
from sglang.srt.configs.model_config import ModelConfig
from sglang.srt.layers.quantization.gptq import GPTQConfig, GPTQMarlinConfig
from sglang.srt.layers.quantization.utils import override_config
from sglang_l3.patches import framework
from sglang_l3.patches.quant import gptq_rocm
from sglang_l3.quant import dispatch
from sglang_l3.quant import gptq_ref as R
from sglang_l3.quant.rocm_gptq import (
    RocmGPTQConfig,
    RocmGPTQLinearScheme,
    moe_method,
    moe_wna16_unsupported,
)

# On a real ROCm machine the plugin (conftest) has already applied gptq-rocm; the
# simulation would fight it. test/gpu covers that machine.
simulated = pytest.mark.skipif(torch.version.hip is not None, reason="real ROCm: the patch is live here")

QWEN_INT4 = {
    "quant_method": "gptq",
    "bits": 4,
    "group_size": 128,
    "desc_act": False,
    "sym": True,
    "checkpoint_format": "gptq",
    "true_sequential": True,
    "static_groups": False,
}


def _spec() -> framework.PatchSpec:
    return next(s for s in framework.load_series() if s.id == "gptq-rocm")


def _simulate_hip(mp: pytest.MonkeyPatch, on: bool = True) -> None:
    mp.setattr(sgl_utils, "is_hip", lambda: on)
    mp.setattr(model_config, "is_hip", lambda: on)
    mp.setattr(marlin_utils, "get_device_capability", lambda *a, **k: (11, 0))


@pytest.fixture
def hip():
    """Simulated HIP with the patch applied; afterwards the patch is undone and the
    queue re-run off HIP, leaving the session's state as conftest made it."""
    mp = pytest.MonkeyPatch()
    _simulate_hip(mp)
    st = framework.apply_one(_spec())
    assert st.state == framework.State.APPLIED, st.detail
    try:
        yield mp
    finally:
        framework.undo("gptq-rocm")
        mp.undo()
        assert framework.apply_one(_spec()).state == framework.State.NOT_APPLICABLE


def _model_config(quantization, hf_quant_cfg) -> ModelConfig:
    """A ModelConfig carrying only what _verify_quantization reads."""
    mc = ModelConfig.__new__(ModelConfig)
    mc.quantization = quantization
    mc._parse_quant_hf_config = lambda: dict(hf_quant_cfg)
    mc._find_quant_modelslim_config = lambda: None
    mc.is_draft_model = False
    return mc


# --------------------------------------------------------------------------- #
# Applicability
# --------------------------------------------------------------------------- #
@simulated
def test_not_applicable_off_rocm() -> None:
    assert gptq_rocm.applicable() == "not ROCm (torch.version.hip is None)"
    st = framework.get_status("gptq-rocm")
    assert st is not None and st.state == framework.State.NOT_APPLICABLE
    assert "gptq" not in quant.QUANTIZATION_METHODS


# --------------------------------------------------------------------------- #
# 1. Registry, allowlist, Marlin
# --------------------------------------------------------------------------- #
@simulated
def test_registry_is_edited_in_place(hip) -> None:
    assert quant.QUANTIZATION_METHODS["gptq"] is RocmGPTQConfig
    assert model_config.QUANTIZATION_METHODS is quant.QUANTIZATION_METHODS  # the reference upstream holds
    assert quant.get_quantization_config("gptq") is RocmGPTQConfig
    assert framework.get_status("gptq-rocm").fired["register_gptq"] == 1


@simulated
def test_undo_removes_the_registration() -> None:
    mp = pytest.MonkeyPatch()
    _simulate_hip(mp)
    try:
        framework.apply_one(_spec())
        assert "gptq" in quant.QUANTIZATION_METHODS
        framework.undo("gptq-rocm")
        assert "gptq" not in quant.QUANTIZATION_METHODS
    finally:
        framework.undo("gptq-rocm")
        mp.undo()
        framework.apply_one(_spec())


@simulated
def test_registration_refuses_a_changed_anchor(monkeypatch) -> None:
    _simulate_hip(monkeypatch)
    monkeypatch.setitem(quant.QUANTIZATION_METHODS, "gptq", GPTQConfig)
    with pytest.raises(framework.PatchError, match="anchor changed"):
        framework.apply_one(_spec())
    assert framework.get_status("gptq-rocm").state == framework.State.FAILED
    monkeypatch.undo()
    assert framework.apply_one(_spec()).state == framework.State.NOT_APPLICABLE


@simulated
def test_upstream_rejects_gptq_on_rocm_without_the_patch(monkeypatch) -> None:
    """Negative control: the defects this patch exists for, on simulated HIP."""
    _simulate_hip(monkeypatch)
    with pytest.raises(ValueError, match="Unknown quantization method: gptq"):
        _model_config("gptq", QWEN_INT4)._verify_quantization()
    # registered but not allowlisted
    monkeypatch.setitem(quant.QUANTIZATION_METHODS, "gptq", RocmGPTQConfig)
    with pytest.raises(ValueError, match="^gptq quantization is currently not supported in ROCm.$"):
        _model_config("gptq", QWEN_INT4)._verify_quantization()
    # no --quantization: upgraded to CUDA-only Marlin (capability (11, 0) >= 80), then refused
    with pytest.raises(ValueError, match="gptq_marlin quantization is currently not supported in ROCm"):
        _model_config(None, QWEN_INT4)._verify_quantization()


@simulated
def test_allowlist_accepts_gptq(hip) -> None:
    mc = _model_config("gptq", QWEN_INT4)
    mc._verify_quantization()
    assert mc.quantization == "gptq"
    assert framework.get_status("gptq-rocm").fired["rocm_allowlist_gptq"] >= 1


@simulated
def test_gptq_checkpoint_is_not_upgraded_to_marlin_on_hip(hip) -> None:
    mc = _model_config(None, QWEN_INT4)
    mc._verify_quantization()
    assert mc.quantization == "gptq"
    assert GPTQMarlinConfig.override_quantization_method(QWEN_INT4, None) is None


@simulated
def test_marlin_choice_is_untouched_off_hip(hip) -> None:
    """The hook delegates to upstream when not on HIP (same process, patch applied)."""
    _simulate_hip(hip, on=False)
    assert GPTQMarlinConfig.override_quantization_method(QWEN_INT4, None) == "gptq_marlin"


@simulated
def test_other_rocm_rejections_still_raise(hip) -> None:
    with pytest.raises(ValueError, match="gptq_marlin quantization is currently not supported in ROCm"):
        _model_config("gptq_marlin", QWEN_INT4)._verify_quantization()
    with pytest.raises(ValueError, match="does not match"):
        _model_config("awq", QWEN_INT4)._verify_quantization()


# --------------------------------------------------------------------------- #
# 2. Config
# --------------------------------------------------------------------------- #
def test_config_accepts_fp16_and_bf16_and_keeps_its_format() -> None:
    cfg = RocmGPTQConfig.from_config({**QWEN_INT4, "hf_config": object(), "packed_modules_mapping": {}})
    assert cfg.get_name() == "gptq" and cfg.declared_format == "v1"
    assert cfg.get_supported_act_dtypes() == [torch.half, torch.bfloat16]
    assert GPTQConfig.get_supported_act_dtypes() == [torch.half]  # upstream, for contrast
    assert "hf_config" not in cfg.full_config and cfg.is_sym is True
    assert RocmGPTQConfig.from_config({**QWEN_INT4, "checkpoint_format": "gptq_v2"}).declared_format == "v2"


def test_pack_factor_is_right_for_3bit_after_override_config() -> None:
    """Upstream's override_config assigns 32 // bits (10 for 3-bit, utils.py:233)."""
    dyn = {r"+:.*\.down_proj": {"bits": 3}}
    ours = RocmGPTQConfig.from_config({**QWEN_INT4, "dynamic": dyn})
    theirs = GPTQConfig.from_config({**QWEN_INT4, "dynamic": dyn})
    a, b = copy.deepcopy(ours), copy.deepcopy(theirs)
    override_config(a, prefix="model.layers.0.mlp.down_proj")
    override_config(b, prefix="model.layers.0.mlp.down_proj")
    assert a.weight_bits == b.weight_bits == 3
    assert b.pack_factor == 10, "upstream defect (negative control)"
    assert a.pack_factor == Fraction(32, 3)


# --------------------------------------------------------------------------- #
# Upstream linear layer end to end (create_weights, weight loader v2, our kernel)
# --------------------------------------------------------------------------- #
@pytest.mark.parametrize(
    "bits,gs,act,sym,stored,declared,dtype",
    [
        (4, 32, True, True, "v2", "gptq", torch.float16),  # Qwen: says v1, stores v2; act-order
        (3, 32, False, False, "v1", "gptq", torch.bfloat16),  # 3-bit pack factor 32/3
        (8, -1, False, True, "v2", "gptq_v2", torch.bfloat16),  # channel-wise
        (2, 64, True, False, "v2", "gptq_v2", torch.float16),
    ],
)
def test_replicated_linear_end_to_end(bits, gs, act, sym, stored, declared, dtype) -> None:
    from sglang.srt.layers.linear import ReplicatedLinear

    K, N = 128, 96
    cfg = RocmGPTQConfig.from_config(
        {**QWEN_INT4, "bits": bits, "group_size": gs, "desc_act": act, "sym": sym, "checkpoint_format": declared}
    )
    lin = ReplicatedLinear(K, N, bias=True, quant_config=cfg, params_dtype=dtype, prefix="model.layers.0.mlp.down_proj")
    assert isinstance(lin.scheme, RocmGPTQLinearScheme) and lin.scheme.prefix.endswith("down_proj")
    assert lin.qweight.shape == (K * bits // 32, N)
    g = torch.Generator().manual_seed(bits)
    L = R.quantize(
        torch.randn(K, N, generator=g) * 0.05, bits, gs, sym=sym, act_order=act, fmt=stored, scale_dtype=dtype
    )
    bias = torch.randn(N, generator=g).to(dtype)
    for name, t in (
        ("qweight", L.qweight),
        ("qzeros", L.qzeros),
        ("scales", L.scales),
        ("g_idx", L.g_idx),
        ("bias", bias),
    ):
        p = getattr(lin, name)
        p.weight_loader(p, t)
    lin.quant_method.process_weights_after_loading(lin)
    sel = lin.scheme.kernel.selection
    assert sel.fmt == stored and sel.check.ok and sel.act_order == act
    assert sel.kernel == "torch-reference"  # CPU without the Triton interpreter
    assert lin.qweight.data_ptr() == sel.tensors["qweight"].data_ptr(), "layer keeps the kernel's copy only"
    x = R.check_inputs(5, K, dtype, "cpu", seed=3)
    out = lin(x)
    out = out[0] if isinstance(out, tuple) else out
    c = R.compare(out, x.float() @ L.w + bias.float(), dtype)
    assert c.ok, c


# --------------------------------------------------------------------------- #
# MoE: delegated to moe_wna16 where its constraints hold, a clear error otherwise
# --------------------------------------------------------------------------- #
@pytest.mark.parametrize(
    "over,reason",
    [
        ({}, None),
        ({"sym": False}, None),  # asymmetric v1: moe_wna16 adds 1 to the zeros, as v1 needs
        ({"checkpoint_format": "gptq_v2"}, None),  # symmetric: zeros ignored
        ({"bits": 3}, "bits=3 (moe_wna16 supports 4 and 8)"),
        ({"desc_act": True}, "desc_act=True (moe_wna16 ignores g_idx)"),
        ({"group_size": -1}, "channel-wise group_size=-1 (moe_wna16 needs groups)"),
        ({"sym": False, "checkpoint_format": "gptq_v2"}, "asymmetric gptq_v2 zeros (moe_wna16 assumes v1)"),
    ],
)
def test_moe_constraints(over, reason) -> None:
    cfg = RocmGPTQConfig.from_config({**QWEN_INT4, **over})
    assert moe_wna16_unsupported(cfg, 2048, 512) == reason
    layer = SimpleNamespace(hidden_size=2048, intermediate_size_per_partition=512)
    if reason is None:
        from sglang.srt.layers.quantization.moe_wna16 import MoeWNA16Method

        m = moe_method(cfg, layer, "model.layers.0.mlp.experts")
        assert isinstance(m, MoeWNA16Method)
        assert m.quant_config.weight_bits == cfg.weight_bits and m.quant_config.has_zp == (not cfg.is_sym)
        assert dispatch.decisions()[-1]["kernel"].startswith("moe_wna16")
    else:
        with pytest.raises(ValueError, match="model.layers.0.mlp.experts.*moe_wna16 path cannot serve"):
            moe_method(cfg, layer, "model.layers.0.mlp.experts")


def test_moe_shape_that_moe_wna16_cannot_regroup() -> None:
    cfg = RocmGPTQConfig.from_config(QWEN_INT4)
    assert moe_wna16_unsupported(cfg, 2048, 48) == "hidden=2048/intermediate=48 not divisible by a group >= 32"
    assert moe_wna16_unsupported(cfg, 2048, 64) is None  # 128 -> 64 fits
