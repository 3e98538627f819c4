#!/bin/sh
# A worktree of an older commit with this tree's fleet simulator on top, to measure that commit's
# supervisor core with today's world (issue 26: "today" vs "after").
#   bench/sim_on_commit.sh COMMIT DIR
# Copies controller/sim/, bench/bench_sim_harm.py and the simulator's property test; where the core
# has no PersistMemory action (before eefe71e), the engine's case for it is dropped (nothing else).
set -eu
commit=$1
dir=$2
git worktree add --detach "$dir" "$commit"
cp controller/sim/*.py "$dir/controller/sim/"
cp bench/bench_sim_harm.py "$dir/bench/"
cp tests/sim/helpers.py tests/sim/test_properties_harm.py "$dir/tests/sim/"
if ! grep -q "class PersistMemory" "$dir/controller/supervisor/actions.py"; then
    python3 - "$dir/controller/sim/engine.py" <<'PY'
import sys
path = sys.argv[1]
text = open(path).read()
for dead in ("    PersistMemory,\n", "            case PersistMemory():\n                self.memory = act.record\n"):
    assert text.count(dead) == 1, dead
    text = text.replace(dead, "")
open(path, "w").write(text)
PY
fi
echo "$dir: $(git -C "$dir" log --oneline -1 | cut -c1-80) with the simulator of $(git rev-parse --short HEAD) (+ working tree)"
