#!/usr/bin/env bash
# Interleaved A/B of `python -m bench.run --sections replay` between two commits.
#
#   bash tools/ab_replay.sh REV_BEFORE REV_AFTER [ROUNDS]
#
# Checks both commits out as temporary git worktrees, then runs the replay
# section ROUNDS times (default 5) alternating before/after, each in a fresh
# process, so both sides see the same machine load; prints, per capacity, the
# median blocktrie / dict-trie ratio of each side and every round's figure.
# Run it from the repository root, with the project installed.
set -euo pipefail
before=${1:?usage: tools/ab_replay.sh REV_BEFORE REV_AFTER [ROUNDS]}
after=${2:?usage: tools/ab_replay.sh REV_BEFORE REV_AFTER [ROUNDS]}
rounds=${3:-5}
work=$(mktemp -d)
cleanup() {
  git worktree remove --force "$work/before" 2>/dev/null || true
  git worktree remove --force "$work/after" 2>/dev/null || true
  rm -rf "$work"
}
trap cleanup EXIT
git worktree add --quiet --detach "$work/before" "$before"
git worktree add --quiet --detach "$work/after" "$after"
for round in $(seq 1 "$rounds"); do
  for side in before after; do
    (cd "$work/$side" && python -m bench.run --sections replay --no-memory \
      --json "$work/$side-$round.json" >/dev/null)
  done
done
python - "$work" <<'PY'
import glob, json, statistics, sys
work = sys.argv[1]
for side in ("before", "after"):
    ratios: dict[float, list[float]] = {}
    for path in sorted(glob.glob(f"{work}/{side}-*.json")):
        for row in json.load(open(path))["replay"]["rows"]:
            if row["impl"] == "blocktrie":
                ratios.setdefault(row["fraction"], []).append(row["vs_dict"])
    cells = ", ".join(
        f"{f}x: {statistics.median(v):.2f} ({' '.join(f'{x:.2f}' for x in v)})"
        for f, v in sorted(ratios.items())
    )
    print(f"{side}: {cells}")
PY
