"""The self-tuning tree: which tree settings pay on the machine at hand, per batch bucket, decided from
the throughput real rounds measure. It holds no tensors of the round and imports no backend.

- setting: `Setting`, the bounded candidate set (plain decoding, and per tree mode one family of
           sizes) and what a round of a family's tree tells of the smaller ones (`hindsight`).
- rule:    the pure policy (`Rule.decide` / `Rule.learn`): confidence bounds on tokens per second,
           exploration within a share of the time, hindsight gains of a family's smaller trees.
- prior:   each candidate's round time timed once through the runner's cost probe (orders exploration).
- cache:   what was measured, on disk per pair, machine and options (`TunerStore`, `CostKey`, the
           rule's estimates to and from JSON).
- online:  `TreeTuner`, the engine's policy: RoundPlans out, RoundReports in.
"""

from .cache import CostKey, TunerStore
from .online import TreeTuner
from .rule import Rule
from .setting import PLAIN, Setting, candidate_settings, hindsight

__all__ = ["CostKey", "PLAIN", "Rule", "Setting", "TreeTuner", "TunerStore", "candidate_settings", "hindsight"]
