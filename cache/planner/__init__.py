"""The capacity planner: workloads, trace readers, the replay loop, planning decisions,
report rendering and the ``blocktrie`` command line.

Layering: the planner depends on the core cache (`cache`), never the other way
round. Its optional dependencies (rich, tqdm, matplotlib: the ``cli`` extra)
are imported only by the functions that draw, and torch only when a cache is
built. Modules, in reading order:

- `cache.planner.workload`: `Request`, `Workload`, the built-in synthetic
  workload and the independent infinite-capacity counter.
- `cache.planner.traces`: trace readers (Mooncake, Alibaba Bailian, token jsonl).
- `cache.planner.policy`: checkpoint placement policies.
- `cache.planner.replay`: the replay loop, written against `CacheLike`.
- `cache.planner.plan`: the planning decisions (which runs, never-evict
  capacity, the recommendation), pure functions.
- `cache.planner.execute`: running the planned replays (here, in forked worker
  processes, or on Ray).
- `cache.planner.report`: the report document (the ``--json`` schema) and its
  text (`cache.planner.table`) and CSV renderings; `cache.planner.plot`: the PNG.
- `cache.planner.fleet`: multi-replica replay behind a router (``--replicas``;
  the prefix router reads only KV-event wire bytes; needs the ``events``
  extra); `cache.planner.publish`: one event publisher per replica (``--publish``).
- `cache.planner.cli`: argparse, usage checks and the ``replay`` / ``demo`` commands.
- `cache.planner.demo`: ``blocktrie demo``.
"""
