"""The self-tuning tree's rule replayed over real acceptance: what docs/results uses to compare rules
side by side without the machine's noise.

``record`` runs the default pair on the demo prompt and the held-out sets with the largest tree of
the tuner's family every round, each reply ending where the benchmark's does (at a stop token), and
keeps, per round, what every tree size of that family would have gained (hindsight: best-first trees
are prefix-closed, setting.hindsight). ``run`` replays the rule
(tuner/rule.py as it stands) over those rounds at given round times, with 10% jitter and a burst of
twice the time in 5% of rounds, the prior off by a common -30%..+30% and by up to 8% per arm; and the
fixed arms (plain decoding, N = 8 and 16) over the same rounds. Each reply also pays its prefill, the
same time for every setting (what the benchmark's per-prompt ratios include: on a short reply it
brings them nearer 1). A setting's round at token position p
gains what the recorded round that covers p gained at that size (acceptance is the text's: a round
that starts inside a recorded one is taken to gain what that one gained).

    python -P -m treeflash_runtime.bench.replay record --out artifacts/replay/gains.json
    python -P -m treeflash_runtime.bench.replay run artifacts/replay/gains.json [--again | --warm] [--seeds 20]

``record --tree-size N`` keeps a smaller tree's own rounds (and the sizes under it in hindsight);
``gains`` sets tapes side by side, each size's tokens per round per set: a size's own run against
what a larger tree's rounds say of it in hindsight (what the tuner learns).

Round and prefill times are per machine profile (``--times``, repeatable); the defaults are the demo
pair's on the development machine's two cores and on one core with one thread (the tuner's own
per-round trace; the prefill the mean over the held-out sets' prompts).
"""

from __future__ import annotations

import json
import math
import random
from dataclasses import dataclass
from pathlib import Path

import click

from treeflash_export.config import TreeConfig

from ..plan import FixedPlans, RoundPlan, RoundReport
from ..tuner.online import best_first
from ..tuner.cache import load_rates, rates_json
from ..tuner.rule import Rule
from ..tuner.setting import FAMILY, PLAIN, Setting, hindsight

SIZES = (4, 8, 16, 32, 64)
M, K = FAMILY["treeflash"]
TREES = [Setting("treeflash", n, M, K) for n in SIZES]
ARMS = [PLAIN] + TREES
FIXED = [PLAIN, TREES[1], TREES[2]]  # the protocol's fixed rows of the default family
PROFILES = {"two cores": "ar=55,4=93,8=112,16=130,32=154,64=208,prefill=128",
            "one core": "ar=67,4=127,8=160,16=165,32=207,64=330,prefill=165"}
NO_PAY = 96  # rounds of a drafter that is never right (every tree gains one token), as a set of its own


@dataclass(frozen=True)
class Profile:
    """A machine profile: plain decoding's step and each tree size's round (ms), and a reply's prefill
    (ms, the same for every setting)."""

    times: dict[Setting, float]
    prefill_ms: float = 0.0


def parse_profile(spec: str) -> Profile:
    """'ar=55,4=93,...,64=208[,prefill=120]': plain decoding's step, each tree size's round and a reply's
    prefill, in ms."""
    times, prefill = {}, 0.0
    for part in spec.split(","):
        key, _, ms = part.partition("=")
        try:
            if key.strip() == "prefill":
                prefill = float(ms)
            else:
                times[PLAIN if key.strip() == "ar" else TREES[SIZES.index(int(key))]] = float(ms)
        except ValueError:
            raise click.BadParameter(f"{spec!r}: {part!r} is not NAME=MS (NAME: ar, prefill or a size of "
                                     f"{SIZES})") from None
    if set(times) != set(ARMS):
        raise click.BadParameter(f"{spec!r}: give ar and every size of {SIZES}")
    if prefill < 0 or min(times.values()) <= 0:
        raise click.BadParameter(f"{spec!r}: times must be positive (the prefill may be 0)")
    return Profile(times, prefill)


class Tape:
    """One recorded generation: per round, each size's gain; a setting at position p replays the round
    that covers p."""

    def __init__(self, rounds: list[dict[str, float]]):
        self.rounds = rounds
        self.top = max(int(n) for n in rounds[0]) if rounds else SIZES[-1]  # the size that ran
        self.starts, pos = [], 0.0
        for r in rounds:
            self.starts.append(pos)
            pos += r[str(self.top)]
        self.total = pos

    def gains(self, s: Setting, pos: float, j: int) -> tuple[dict[Setting, float], int]:
        """(gains of s and the trees it covers at position pos, the recorded round's index)."""
        while j + 1 < len(self.starts) and self.starts[j + 1] <= pos:
            j += 1
        if s == PLAIN:
            return {PLAIN: 1.0}, j
        return {t: float(self.rounds[j][str(t.tree_size)]) for t in TREES if t.tree_size <= s.tree_size}, j


def play(tape: Tape, profile: Profile, seed: int, rule: Rule | None = None, fixed: Setting | None = None) -> float:
    """Tokens per second of the rule (or of a fixed setting) over the tape at the profile's times, its
    prefill included."""
    rng = random.Random(seed)
    times = profile.times
    pos, ms_total = 0.0, profile.prefill_ms
    j = 0
    while pos < tape.total:
        s, exploring = (fixed, False) if rule is None else rule.decide(1)
        ms = times[s] * rng.uniform(0.9, 1.1) * (2.0 if rng.random() < 0.05 else 1.0)
        gains, j = tape.gains(s, pos, j)
        if rule is not None:
            rule.learn(1, s, ms, gains, exploring, ms)
        pos += min(gains[s], tape.total - pos)
        ms_total += ms
    return 1000.0 * tape.total / ms_total


def new_rule(times: dict[Setting, float], seed: int) -> Rule:
    """A fresh rule whose prior is off as this seed draws it: by a common -30%..+30% and up to 8% per arm."""
    rng = random.Random(7 * seed + 1)
    common = rng.uniform(-0.3, 0.3)
    prior = {s: ms * (1.0 + common + rng.uniform(-0.08, 0.08)) for s, ms in times.items()}
    return Rule(ARMS, lambda b: prior, block_size=16)


SHORT = 0.9  # the mark: a run below this share of the best fixed arm counts as one that fell short


def run_spread(ratios: list[float]) -> dict:
    """How runs (each the rule's tokens/s over the best fixed arm's) spread: the worst, the tenth worst
    in a hundred (the worst alone is one seed's luck), and the share of runs below SHORT (a rule that
    locks into a small tree or plain decoding on some runs shows there, not in the sum)."""
    ranked = sorted(ratios)
    return {"worst_x_best": ranked[0], "tenth_x_best": ranked[(len(ranked) - 1) // 10],
            "short_share": sum(r < SHORT for r in ranked) / len(ranked)}


def replay(tapes: dict[str, list[Tape]], profile: Profile, seeds: int, again: bool) -> dict:
    """Per set: the rule's tokens/s summed over prompts and seeds as a share of the best fixed arm's
    (chosen per prompt and seed, as the protocol's best row) and of plain decoding's, and how the runs
    spread (run_spread). Every set gets as many runs: a set of fewer prompts (the demo prompt alone) runs
    each more often, seeds times the largest set's prompts over its own."""
    out = {}
    most = max(len(group) for group in tapes.values())
    for name, group in tapes.items():
        got = best = plain = 0.0
        ratios = []
        for tape in group:
            for seed in range(seeds * math.ceil(most / len(group))):
                fixed = {s: play(tape, profile, seed, fixed=s) for s in FIXED}
                rule = new_rule(profile.times, seed)
                rate = play(tape, profile, seed, rule)
                if again:  # a second process, from what the first measured (as the tuner's cache)
                    first, rule = rule, new_rule(profile.times, seed)
                    load_rates(rule, rates_json(first))
                    rule.new_request()
                    rate = play(tape, profile, seed + 1000, rule)
                top = max(fixed.values())
                got, best, plain = got + rate, best + top, plain + fixed[PLAIN]
                ratios.append(rate / top)
        out[name] = {"x_best": got / best, "x_plain": got / plain, **run_spread(ratios)}
    return out


def replay_warm(tapes: dict[str, list[Tape]], profile: Profile, seeds: int, runs: int = 2) -> dict:
    """As the held-out rows of the protocol: per set and seed, one rule over the set's prompts in turn
    (a warm-up over the first, then ``runs`` passes), each prompt a new request; per prompt, the rule's
    tokens/s over the passes against plain decoding's over the same rounds. Per set: the summed share
    of plain decoding's, the median over seeds of the slowest prompt's, and the slowest of all."""
    out = {}
    for name, group in tapes.items():
        rule_ms = plain_ms = 0.0
        slowest = []
        for seed in range(seeds):
            rule = new_rule(profile.times, seed)
            play(group[0], profile, 1000 * seed, rule)
            took = [[0.0, 0.0] for _ in group]  # per prompt: the rule's ms, plain decoding's ms
            for r in range(runs):
                for j, tape in enumerate(group):
                    rule.new_request()
                    at = 1000 * seed + 100 * r + j + 1
                    took[j][0] += 1000.0 * tape.total / play(tape, profile, at, rule)
                    took[j][1] += 1000.0 * tape.total / play(tape, profile, at, fixed=PLAIN)
            rule_ms += sum(t[0] for t in took)  # both decode the same tokens: the rates' ratio is the times'
            plain_ms += sum(t[1] for t in took)
            slowest.append(min(p / a for a, p in took))
        slowest.sort()
        out[name] = {"x_plain": plain_ms / rule_ms, "slowest_prompt_median": slowest[len(slowest) // 2],
                     "slowest_prompt": slowest[0]}
    return out


def load_tapes(path: Path) -> dict[str, list[Tape]]:
    data = json.loads(Path(path).read_text())
    tapes = {name: [Tape(r) for r in group] for name, group in data.items()}
    tapes["no tree pays"] = [Tape([{str(n): 1.0 for n in SIZES}] * NO_PAY)]
    return tapes


class Recorder(FixedPlans):
    """The policy ``record`` runs: one tree every round, reporting its nodes; keeps, per round of the
    generation under way, what every size of its family would have gained."""

    def __init__(self, tree: TreeConfig):
        super().__init__({1: tree})
        self.plans = {1: RoundPlan(tree=tree, report_nodes=True)}
        self.fixed_mode = tree.mode
        self.ran = Setting(tree.mode, tree.tree_size, tree.top_m, tree.top_k)
        self.rounds: list[dict[str, float]] = []

    def new_generation(self) -> None:
        self.rounds = []

    def learn(self, report: RoundReport, running=None) -> None:
        gains = hindsight(self.ran, best_first(report.nodes[0]), TREES)
        self.rounds.append({str(s.tree_size): g for s, g in gains.items()})

    def report(self) -> dict:
        return {}


@click.group()
def main():
    """Replays the self-tuning tree's rule over recorded acceptance."""


@main.command()
@click.option("--out", default="artifacts/replay/gains.json", type=click.Path(dir_okay=False), show_default=True)
@click.option("--heldout", default=10, show_default=True, help="Prompts per held-out set.")
@click.option("--max-new-tokens", default=96, show_default=True)
@click.option("--tree-size", default=SIZES[-1], type=click.Choice([str(n) for n in SIZES]), show_default=True,
              help="The tree every round runs (the tape holds its gain and each smaller size's; `run` needs the "
                   "largest).")
def record(out, heldout, max_new_tokens, tree_size):
    """Records, per round, every tree size's gain on the demo prompt and the held-out sets (the default
    pair, on CPU; a few minutes)."""
    from ..cli import _encode
    from ..engine import fixed_plans
    from ..loop import generate
    from ..options import load_session
    from .cli import _prompt_ids, reply_sampling
    from .protocol import PROMPT

    tree = TreeConfig(mode="treeflash", tree_size=int(tree_size), top_m=M, top_k=K)
    sess = load_session(model=None, drafter=None, artifacts=None, verify_checksums=False, mode=tree.mode,
                        tree_size=tree.tree_size, top_m=M, top_k=K, drafter_temperature=None, max_seq_len=None,
                        device="cpu", dtype="float32", cuda_graphs="auto", fast_kernels="auto")
    ran = fixed_plans(sess.runner, tree).trees[1]
    recorder = Recorder(ran)
    sets = {"demo": [_encode(sess.tokenizer, PROMPT, True)]}
    for domain in ("chat-self", "code", "chat-stdlib"):
        sets[domain] = _prompt_ids(("heldout", heldout, 48, domain), sess.tokenizer)
    sampling = reply_sampling(sess, max_new_tokens)  # each reply ends where the benchmark's does
    data = {}
    for name, prompts in sets.items():
        data[name] = []
        for ids in prompts:
            generate(sess.runner, ids, ran, sampling, tuner=recorder)
            data[name].append(recorder.rounds)
        click.echo(f"{name}: {len(prompts)} prompts, {sum(len(r) for r in data[name])} rounds", err=True)
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(out).with_suffix(".tmp")
    tmp.write_text(json.dumps(data))
    tmp.replace(out)


@main.command()
@click.argument("gains", type=click.Path(exists=True, dir_okay=False))
@click.option("--times", "profiles", multiple=True,
              help="A machine profile's round times and a reply's prefill in ms, "
                   "'ar=55,4=93,8=112,16=130,32=154,64=208,prefill=120' (repeatable; prefill optional, 0 if left out; "
                   "default: the demo pair's on two cores and on one core).")
@click.option("--seeds", default=20, show_default=True,
              help="Runs per prompt (jitter, bursts and the prior's error); a set of fewer prompts runs each more "
                   "often, as many runs in all as the largest set.")
@click.option("--again", is_flag=True, help="Each run from what a first run over the same prompt measured.")
@click.option("--warm", is_flag=True, help="One rule over each set's prompts in turn, as the protocol's held-out rows "
                                          "(twice, after a warm-up), per prompt against plain decoding.")
@click.option("--json", "as_json", is_flag=True)
def run(gains, profiles, seeds, again, warm, as_json):
    """Prints, per profile and set, the rule's tokens/s as a share of the best fixed arm and of plain decoding
    (--warm: of plain decoding's, summed and for the slowest prompt)."""
    if again and warm:
        raise click.UsageError("--again and --warm are two different replays: give one")
    tapes = load_tapes(Path(gains))
    if any(t.top != SIZES[-1] for group in tapes.values() for t in group):
        raise click.UsageError(f"{gains}: recorded with a smaller tree; `run` replays a tape of N = {SIZES[-1]}")
    named = {p: parse_profile(p) for p in profiles} or {k: parse_profile(v) for k, v in PROFILES.items()}
    res = {name: replay_warm(tapes, prof, seeds) if warm else replay(tapes, prof, seeds, again)
           for name, prof in named.items()}
    if as_json:
        click.echo(json.dumps(res))
        return
    for name, sets in res.items():
        click.echo(name)
        for s, r in sets.items():
            if warm:
                click.echo(f"  {s:<14} {r['x_plain']:.3f}x plain summed, slowest prompt {r['slowest_prompt_median']:.2f}x "
                           f"(median over runs), {r['slowest_prompt']:.2f}x at worst")
            else:
                click.echo(f"  {s:<14} {r['x_best']:.3f}x the best fixed, {r['x_plain']:.3f}x plain; runs: worst "
                           f"{r['worst_x_best']:.2f}x the best, a tenth at or below {r['tenth_x_best']:.2f}x, "
                           f"{r['short_share']:.0%} below {SHORT}x")


def mean_gains(tapes: list[Tape]) -> dict[int, float]:
    """Tokens per round of each size a set's tapes hold, over all their rounds."""
    rounds = [r for t in tapes for r in t.rounds]
    return {int(n): sum(r[n] for r in rounds) / len(rounds) for n in rounds[0]} if rounds else {}


@main.command()
@click.argument("files", nargs=-1, required=True, type=click.Path(exists=True, dir_okay=False))
def gains(files):
    """Per set and tree size, the tokens per round each tape (from `record --tree-size`) says: the tape
    of a size's own rounds against a larger tree's, where the tuner reads it in hindsight."""
    cols = [{name: mean_gains([Tape(r) for r in group]) for name, group in json.loads(Path(f).read_text()).items()}
            for f in files]  # per file: set -> size -> tokens per round
    for name in cols[0]:
        click.echo(f"{name}: tokens per round by the tape of each size that ran")
        click.echo("  size  " + "".join(f"{'N=' + str(max(c.get(name, {}), default=0)):>9}" for c in cols))
        for size in SIZES:
            cells = [f"{c[name][size]:9.3f}" if size in c.get(name, {}) else " " * 9 for c in cols]
            click.echo(f"  {size:>4}  " + "".join(cells))


if __name__ == "__main__":
    main()
