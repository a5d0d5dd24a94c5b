"""The round contract between the engine and a runner: a frozen ``RoundPlan`` in, a ``RoundReport``
value out (as vLLM v1's schedule -> execute_model -> update_from_output). The engine asks its policy
(a fixed tree, or the self-tuning tree) for the plan, the runner executes it over its occupied slots
and says what happened; nothing else passes between them.

Also the one capacity rule (what a slot's cache must hold) and the one prefill-chunk constant.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from treeflash_export.config import TreeConfig
from treeflash_export.errors import ConfigError

# Prompt tokens per prefill pass: the scheduler's chunk while others run, and the captured prefill
# pass's static width (each slot's cache carries this many spare slots so padded passes never overflow).
PREFILL_CHUNK = 256
PLAIN_TREE = TreeConfig(mode="ar")


@dataclass(frozen=True)
class RoundPlan:
    """What one round does, over the occupied slots (run as their batch bucket).

    tree          the tree every slot drafts and verifies, resolved (TreeConfig.resolved); mode 'ar':
                  plain decoding
    report_nodes  the round reports its verified nodes (RoundReport.nodes): path scores, ranks and
                  whether each was accepted (trees of at most 64 nodes)
    keep_context  plain steps keep the drafter's context current, so that a tree round may follow
    may_capture   with CUDA graphs, a round whose graph is not captured yet captures it (False: it runs
                  eagerly, e.g. a setting tried once)
    """

    tree: TreeConfig = PLAIN_TREE
    report_nodes: bool = False
    keep_context: bool = False
    may_capture: bool = True

    @property
    def plain(self) -> bool:
        return self.tree.mode == "ar"


@dataclass(frozen=True)
class NodeReport:
    """One slot's verified nodes (host lists, root excluded, tree order): path score, largest parent
    row and child rank on the path (treeflash_export.tree.node_paths), and whether accepted (1.0/0.0).
    Padding nodes of a tree that could not be filled score -inf."""

    scores: list[float]
    m_rank: list[float]
    k_rank: list[float]
    accepted: list[float]


@dataclass(frozen=True)
class RoundReport:
    """What one round did, per occupied slot (slot order).

    gained    tokens each slot gained: accepted drafts, then the bonus (empty for an inactive slot)
    seconds   the round's wall time, read-back included
    captured  the round captured its CUDA graph (its time is not a replay's)
    eager     on a graph runner, the round ran without a graph (may_capture was False)
    nodes     per slot, the round's verified nodes when the plan asked for them (else None)
    """

    tree: TreeConfig
    gained: list[list[int]]
    seconds: float = 0.0
    captured: bool = False
    eager: bool = False
    nodes: list[NodeReport] | None = None
    drafted: int = field(init=False)  # draft nodes each active slot verified (0 for plain decoding)

    def __post_init__(self):
        object.__setattr__(self, "drafted", 0 if self.tree.mode == "ar" else self.tree.tree_size - 1)


class Policy:
    """What the engine asks each round (FixedPlans and the self-tuning tree implement it): start()
    before the first admission, admitted(key, alone) / retired(key) as requests come and go,
    plan(bucket, running keys) -> RoundPlan before each round, learn(report, [(slot, key) of the
    running]) after it, close() when the engine stops; max_tree_size is what every request's cache
    must hold. The hooks do nothing unless a policy needs them."""

    max_tree_size: int

    def plan(self, bucket: int, requests=None) -> RoundPlan:
        raise NotImplementedError

    def learn(self, report: RoundReport, running=None) -> None:
        pass

    def start(self) -> None:
        pass

    def admitted(self, key, alone: bool) -> None:
        pass

    def retired(self, key) -> None:
        pass

    def close(self) -> None:
        pass


class FixedPlans(Policy):
    """The policy of a deployment without the self-tuning tree: each bucket's tree, every round."""

    def __init__(self, trees: dict[int, TreeConfig]):
        if not trees:
            raise ConfigError("internal error: no tree to run (a runner without a deployment tree needs a policy)")
        self.trees = trees
        self.plans = {b: RoundPlan(tree=t) for b, t in trees.items()}
        self.max_tree_size = max(max(t.tree_size, 1) for t in trees.values())

    def plan(self, bucket: int, requests=None) -> RoundPlan:
        return self.plans[bucket]


def checked_tree(runner, tree: TreeConfig) -> TreeConfig:
    """The tree setting as this runner will use it (resolved), after checking that the runner can."""
    if tree.mode != "ar":
        if runner.block_size < 2:
            raise ConfigError(f"mode {tree.mode!r} needs a drafter; this runner has none (use mode 'ar')")
        tree.validate(block_size=runner.block_size, vocab_size=runner.draft_vocab_size or runner.vocab_size,
                      has_head=runner.has_head)
    return tree.resolved(runner.block_size)


def required_capacity(prompt_len: int, max_new_tokens: int, tree_size: int) -> int:
    """Cache slots needed: the last round starts at P <= prompt + max_new - 1 and writes N tree slots."""
    return prompt_len + max_new_tokens - 1 + max(tree_size, 1)


def largest_budget(prompt_len: int, tree_size: int, capacity: int) -> int:
    """The most new tokens a prompt of prompt_len leaves room for (required_capacity solved for it;
    < 1: the prompt itself does not fit with a tree)."""
    return capacity - prompt_len + 1 - max(tree_size, 1)


def check_fits(prompt_len: int, max_new_tokens: int, tree_size: int, capacity: int, client: bool = False) -> None:
    """The one capacity check: a prompt and budget that a cache of ``capacity`` slots cannot hold with
    trees of ``tree_size`` nodes is a one-line error saying what to change: the command line's flags,
    or (client: a served request) the largest budget that fits."""
    if prompt_len < 1:
        raise ConfigError("the prompt is empty")
    if prompt_len > capacity:
        raise ConfigError(f"the prompt is {prompt_len} tokens but the cache holds {capacity}: "
                          f"shorten the prompt or raise --max-seq-len")
    need = required_capacity(prompt_len, max_new_tokens, tree_size)
    if need > capacity:
        most = largest_budget(prompt_len, tree_size, capacity)
        if client:
            fix = f"ask for at most {most} tokens" if most >= 1 else "shorten the prompt"
        else:
            fix = "lower --max-new-tokens or raise --max-seq-len"
        raise ConfigError(f"prompt ({prompt_len}) + max new tokens ({max_new_tokens}) + tree ({tree_size}) needs "
                          f"{need} cache slots but the cache holds {capacity}: {fix}")
