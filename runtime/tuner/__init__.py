"""The self-tuning tree: which settings pay on the machine at hand, per batch bucket.

A pure policy over measurements; it holds no tensors of the round and imports no backend. The
runner implements the probe (`cost.Probe`) that times a round's parts, feeds each verified round
back as an `acceptance.Observation`, and runs the `Setting` it is given.

- setting:    `Setting`, the bounded candidate sets and `candidate_settings`.
- cost:       the measured cost model (`measure` over the probe, `CostModel.round_ms`).
- cache:      the on-disk cache of cost models (`CostCache`, `CostKey`, `pair_fingerprint`).
- acceptance: calibrated P(accepted | path score) and expected tokens per setting.
- policy:     `choose` (tokens per second, plain decoding the fallback, hysteresis) and
              `resolve_settings` / `parse_auto` for explicit values and 'auto'.
- auto:       `AutoTuner`, the per-round object that explores, then chooses.
"""

from .acceptance import AcceptanceModel, Observation, RequestStream
from .auto import AutoTuner
from .cache import CostCache, CostKey, pair_fingerprint
from .cost import BucketCosts, CostModel, Grid, default_grid, measure
from .policy import Choice, choose, parse_auto, resolve_settings
from .setting import PLAIN, Setting, candidate_settings

__all__ = ["AcceptanceModel", "AutoTuner", "BucketCosts", "Choice", "CostCache", "CostKey", "CostModel", "Grid",
           "Observation", "PLAIN", "RequestStream", "Setting", "candidate_settings", "choose", "default_grid",
           "measure", "pair_fingerprint", "parse_auto", "resolve_settings"]
