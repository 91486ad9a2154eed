"""The capacity planner: workloads, trace readers, the replay loop, planning decisions,
report rendering and the ``blocktrie`` command line.

Layering: the planner depends on the core cache (`cache`), never the other way
round. Its optional dependencies (rich, tqdm, matplotlib: the ``cli`` extra)
are imported only by the functions that draw, and torch only when a cache is
built. Modules, in reading order:

- `cache.planner.workload`: `Request`, `Workload`, the built-in synthetic
  workload and the independent infinite-capacity counter.
- `cache.planner.traces`: trace readers (Mooncake, token jsonl).
- `cache.planner.policy`: checkpoint placement policies.
- `cache.planner.replay`: the replay loop, written against `CacheLike`.
- `cache.planner.plan`: the planning decisions (which runs, never-evict
  capacity, the recommendation), pure functions.
- `cache.planner.report`, `cache.planner.plot`: rendering.
- `cache.planner.cli`: argparse and the ``replay`` / ``demo`` commands.
- `cache.planner.demo`: ``blocktrie demo``.
"""
