"""The tuner the runner asks each round: which setting to run, and what the round showed.

It ties the three parts together and adds exploration, because the acceptance model can only
predict a setting from a round whose tree held that setting's nodes: for each family of
candidates (TreeFlash, marginal, chain) it first runs one round at the family's probe setting, the
largest N, M and K among the family's candidates that could pay at all (a round gains at most
min(N, B) tokens, so a setting dearer than that many plain steps never can); best-first trees are
prefix-closed, so that one tree predicts every smaller candidate of its family. After that it runs
the choice, and every `explore_every` rounds one probe round again (families in turn) so the
estimates of larger settings than the chosen one stay fresh.

    tuner = AutoTuner(cost, AcceptanceModel(), candidates, block_size=16)
    s = tuner.setting(bucket)            # the Setting to run this round
    tuner.observe(Observation(...))      # after verification
"""

from __future__ import annotations

from treeflash_export.errors import ConfigError

from .acceptance import AcceptanceModel, Observation, RequestStream
from .cost import CostModel
from .policy import Choice, can_pay, choose
from .setting import PLAIN, Setting


class AutoTuner:
    def __init__(self, cost: CostModel, acceptance: AcceptanceModel, candidates: list[Setting], block_size: int,
                 hysteresis: float = 0.03, explore_every: int = 64, plain: bool = True):
        self.cost, self.acceptance, self.block_size = cost, acceptance, block_size
        self.candidates = list(candidates)
        self.hysteresis, self.explore_every, self.plain = hysteresis, explore_every, plain
        self.current: dict[int, Setting] = {}
        self.choices: dict[int, Choice] = {}
        self.rounds = 0
        self._next_family = 0

    def families(self) -> list[str]:
        return [m for m in ("treeflash", "marginal", "chain") if any(s.mode == m for s in self.candidates)]

    def probe_setting(self, family: str, bucket: int) -> Setting | None:
        """The family's largest candidate shape that could pay (None: none can)."""
        fam = [s for s in self.candidates if s.mode == family and can_pay(self.cost, s, bucket, self.block_size)]
        if not fam:
            return None
        return Setting(family, max(s.tree_size for s in fam), max(s.top_m for s in fam), max(s.top_k for s in fam))

    def _unexplored(self) -> list[str]:
        return [f for f in self.families() if not any(
            self.acceptance.expected(s, None, self.block_size) is not None for s in self.candidates if s.mode == f)]

    def setting(self, bucket: int = 1, stream: RequestStream | None = None) -> Setting:
        """The setting to run next at this batch bucket."""
        families = self._unexplored()
        if not families and self.explore_every and self.rounds and self.rounds % self.explore_every == 0:
            fams = self.families()
            families = [fams[self._next_family % len(fams)]] if fams else []
            self._next_family += 1
        for f in families:
            probe = self.probe_setting(f, bucket)
            if probe is not None:
                return probe
        try:
            choice = choose(self.cost, self.acceptance, bucket, self.candidates, self.current.get(bucket),
                            self.hysteresis, stream, self.block_size, self.plain)
        except ConfigError:  # nothing predictable and nothing to explore that could pay
            return PLAIN if self.plain else self.candidates[0]
        self.choices[bucket] = choice
        self.current[bucket] = choice.setting
        return choice.setting

    def observe(self, obs: Observation | None, stream: RequestStream | None = None) -> None:
        """After a round: its observation (None for a plain decoding round, which teaches nothing)."""
        self.rounds += 1
        if obs is not None:
            self.acceptance.observe(obs, stream)

    def report(self) -> dict:
        """For --json: the latest choice per bucket and the rounds seen."""
        return {"rounds": self.rounds, "choices": {str(b): c.to_json() for b, c in sorted(self.choices.items())}}
