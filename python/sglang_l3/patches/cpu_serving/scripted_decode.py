"""Patch `scripted-decode` (why: patches/series.toml): the CPU test server's
sampled tokens follow a script chosen from each request's prompt
(sglang_l3.cpu_serving.decode_script), and the model's own log-probability of
every forced token is recorded per request.

How: AROUND `ModelRunner.sample`, the log-softmax of the logits is kept before
upstream's sampler edits them in place (temperature, penalties, softmax). AROUND
`TpModelWorker.forward_batch_generation`: upstream runs the forward and samples; then, for every request of the batch that is at a sampling point (the
last chunk of its prefill, or a decode step) and whose prompt a rule matches, the
sampled id is replaced by the script's next token and the kept log-probability of
that row at the token is recorded (also written into `next_token_logprobs` when the
request asked for logprobs). Everything after (the next step's input, the output
processor, detokenizer, reasoning and tool-call parsers) sees the forced token as
if the model had sampled it. A delayed sample (overlap with a grammar) is wrapped
the same way. Only TP rank 0 writes the record; every rank forces the same tokens
(the script and the prompt are the same on every rank).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from typing import Any, cast

from sglang_l3 import envs
from sglang_l3.patches.framework import PatchContext

_TARGET = "sglang.srt.managers.tp_worker:TpModelWorker.forward_batch_generation"
_SAMPLE = "sglang.srt.model_executor.model_runner:ModelRunner.sample"
_RAW = "sglang_l3_raw_logprobs"  # attribute on the LogitsProcessorOutput
_MAX_LIVE = 4096  # requests with a script in flight (a finished or aborted one may linger)


def applicable() -> str | None:
    from sglang_l3.cpu import not_applicable_reason
    from sglang_l3.cpu_serving.decode_script import ENV, configured

    reason = not_applicable_reason()
    if reason:
        return reason
    if not envs.value(ENV).strip():
        return f"{ENV} not set (scripted decode is for tests)"
    configured()  # a bad script is an error at start-up, not a silent no-op
    return None


class _Scripter:
    def __init__(self, worker: Any) -> None:
        import torch
        from sglang.srt.distributed.parallel_state import get_tensor_model_parallel_rank
        from transformers import AutoTokenizer

        from sglang_l3.cpu_serving.decode_script import Recorder, configured

        self.torch = torch
        self.script = configured()
        args = worker.server_args
        self.tok = AutoTokenizer.from_pretrained(args.tokenizer_path or args.model_path)
        self.eos = self.tok.convert_tokens_to_ids("<|im_end|>")
        self.recorder = Recorder(self.script.record, write=get_tensor_model_parallel_rank() == 0)
        self.live: OrderedDict[str, Any] = OrderedDict()

    def _start(self, req: Any) -> Any:
        from sglang_l3.cpu_serving.decode_script import Forced

        self.live.pop(req.rid, None)
        ids = list(req.origin_input_ids)
        # one sequence of ids decodes to one str (transformers types it str | list[str])
        chosen = self.script.choose(cast(str, self.tok.decode(ids, skip_special_tokens=False)))
        if chosen is None:
            return None
        rule, k = chosen
        tokens = self.tok.encode(rule.steps[k].text(), add_special_tokens=False) + [self.eos]
        sid = getattr(req, "session_id", None)
        forced = Forced(
            rid=req.rid,
            rule=rule.marker,
            step=k,
            tokens=tokens,
            prompt_ids=ids,
            session=str(sid) if sid is not None else None,
        )
        self.live[req.rid] = forced
        while len(self.live) > _MAX_LIVE:
            self.live.popitem(last=False)
        return forced

    def _at_sampling_point(self, batch: Any, req: Any) -> bool:
        mode = batch.forward_mode
        if mode.is_decode():
            return True
        if not mode.is_extend():
            return False
        end = getattr(req, "extend_end", None)
        return end is None or end >= len(req.full_untruncated_fill_ids)

    def apply(self, batch: Any, result: Any) -> int:
        """Force the batch's scripted tokens; returns how many."""
        ids = result.next_token_ids
        if ids is None or batch is None or not batch.reqs:
            return 0
        n = 0
        # log-probabilities of the logits as the model produced them, taken before
        # upstream's sampler scaled / penalised / softmaxed them in place
        logits = getattr(result.logits_output, _RAW, None) if result.logits_output is not None else None
        for i, req in enumerate(batch.reqs):
            if not self._at_sampling_point(batch, req):
                continue
            forced = self.live.get(req.rid)
            if batch.forward_mode.is_extend() and (forced is None or not req.output_ids):
                forced = self._start(req)  # a prefill (or a retracted request's) starts afresh
            if forced is None or forced.pos >= len(forced.tokens):
                continue
            tok = forced.tokens[forced.pos]
            ids[i] = tok
            if logits is not None:
                lp = float(logits[i, tok])
                forced.logprobs.append(lp)
                out = result.logits_output.next_token_logprobs
                if out is not None:
                    out[i] = lp
            forced.pos += 1
            n += 1
            if forced.pos == len(forced.tokens):
                for name in ("cached_tokens", "cached_tokens_device", "cached_tokens_host", "cached_tokens_storage"):
                    forced.cached[name.removeprefix("cached_tokens").lstrip("_") or "total"] = int(
                        getattr(req, name, 0)
                    )
                self.recorder.add(forced.record(self.script.record_prompt_ids))
                self.live.pop(req.rid, None)
        return n


def apply(ctx: PatchContext) -> None:
    state: dict[int, _Scripter] = {}

    def scripter(worker: Any) -> _Scripter:
        key = id(worker)
        if key not in state:
            state[key] = _Scripter(worker)
        return state[key]

    def forward_batch_generation(original: Callable, self: Any, batch: Any = None, *args: Any, **kwargs: Any) -> Any:
        result = original(self, batch, *args, **kwargs)
        if batch is None or kwargs.get("is_verify"):
            return result
        s = scripter(self)
        delayed = getattr(result, "delay_sample_func", None)
        if delayed is not None:

            def sample_then_force() -> Any:
                out = delayed()
                if s.apply(batch, out):
                    ctx.fired("delayed")
                return out

            result.delay_sample_func = sample_then_force
        elif s.apply(batch, result):
            ctx.fired("forced")
        return result

    def sample(original: Callable, self: Any, logits_output: Any, forward_batch: Any, *args: Any, **kwargs: Any) -> Any:
        raw = getattr(logits_output, "next_token_logits", None)
        if raw is not None:
            setattr(logits_output, _RAW, raw.float().log_softmax(dim=-1))
        return original(self, logits_output, forward_batch, *args, **kwargs)

    ctx.around(_SAMPLE, sample)
    ctx.around(_TARGET, forward_batch_generation)
