"""`treeflash-run --prompts-file`: many prompts, served together through the in-flight batching
engine (torch backend; the graph backends hold one slot, so one after another), results in input
order."""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path

from treeflash_export.config import SamplingConfig
from treeflash_export.errors import ConfigError

FIELDS = {"prompt": str, "max_new_tokens": int, "temperature": (int, float), "top_p": (int, float), "seed": int}


@dataclass
class PromptLine:
    line: int
    prompt: str
    sampling: SamplingConfig


def read_prompts_file(path: str | Path, defaults: SamplingConfig) -> list[PromptLine]:
    """Every line a JSON object with "prompt" and optionally max_new_tokens, temperature, top_p and
    seed (the command line's values otherwise). All lines are checked before anything runs; a bad
    one is a one-line error naming the file and the line."""
    path = Path(path)
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"--prompts-file {path}: cannot read it ({exc})") from None
    out = []
    for number, text in enumerate(lines, 1):
        if not text.strip():
            continue
        where = f"{path}:{number}"
        try:
            record = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ConfigError(f"{where}: not JSON ({exc.msg})") from None
        if not isinstance(record, dict):
            raise ConfigError(f"{where}: a line must be a JSON object with \"prompt\", got {type(record).__name__}")
        unknown = sorted(set(record) - set(FIELDS))
        if unknown:
            raise ConfigError(f"{where}: unknown field {unknown[0]!r}; a line takes {', '.join(FIELDS)}")
        for key, kind in FIELDS.items():
            value = record.get(key)
            if value is not None and (not isinstance(value, kind) or isinstance(value, bool)):
                what = "a string" if kind is str else "a number"
                raise ConfigError(f"{where}: {key!r} must be {what}, got {value!r}")
        if not record.get("prompt"):
            raise ConfigError(f"{where}: no \"prompt\" (a non-empty string)")
        # null is "not given": the command line's value (as for a field left out)
        settings = {k: record[k] for k in FIELDS if k != "prompt" and record.get(k) is not None}
        sampling = dataclasses.replace(defaults, **settings)
        try:
            sampling.validate()
        except ConfigError as exc:
            raise ConfigError(f"{where}: {exc}") from None
        out.append(PromptLine(number, record["prompt"], sampling))
    if not out:
        raise ConfigError(f"--prompts-file {path} holds no prompt")
    return out


def run_prompt_lines(session, lines: list[PromptLine], encode, progress) -> list[dict]:
    """Generates every line through the engine on the session's runner (its slots at once; a one-slot
    runner one after another); returns per line the fields of treeflash-run's --json (timings from
    submission, so they include waiting for a slot)."""
    from .engine import Engine, fixed_plans
    from .scheduler import Request

    runner = session.runner
    policy = session.tuner
    if policy is None and not (runner.deployment and runner.max_batch > 1):  # else the runner's tree by bucket
        policy = fixed_plans(runner, session.tree)
    requests = [Request(encode(line.prompt), line.sampling) for line in lines]
    Engine(runner, policy=policy).run(requests, progress=lambda r: progress())  # submits (checks) all, then runs
    results = []
    for request, line in zip(requests, lines):
        end = request.token_times[-1] if request.token_times else request.submitted_at
        results.append(_fields(request.tokens, request.accept_lengths, request.stop_reason, len(request.prompt_ids),
                               (request.first_token_at or end) - request.submitted_at, end - request.submitted_at,
                               line.sampling))
    return results


def _fields(tokens, accept_lengths, stop_reason, prompt_tokens, prefill_s, elapsed_s, sampling) -> dict:
    return {
        "token_ids": tokens, "rounds": len(accept_lengths), "accept_lengths": accept_lengths,
        "mean_accepted": sum(accept_lengths) / len(accept_lengths) if accept_lengths else 0.0,
        "new_tokens": len(tokens), "elapsed_s": elapsed_s,
        "tokens_per_s": len(tokens) / elapsed_s if elapsed_s > 0 else 0.0, "prefill_s": prefill_s,
        "prompt_tokens": prompt_tokens, "stop_reason": stop_reason, "temperature": sampling.temperature,
        "top_p": sampling.top_p, "seed": sampling.seed,
    }
