"""A minimal worker written to NVIDIA Dynamo Snapshot's control-directory contract (no gpusnap code).

    SNAPSHOT_CONTROL_DIR=DIR python controldir_worker.py WORKDIR

Counts in WORKDIR/count; once WORKDIR/capture exists it "quiesces" (stops counting), writes
DIR/ready-for-snapshot and polls every 100 ms: restore-complete => apply restore-context.json to its
environment, clear the sentinels, count on and record MODE in WORKDIR/env; snapshot-complete => exit 0.
"""

import json
import os
import sys
import time

wd = sys.argv[1]
ctl = os.environ["SNAPSHOT_CONTROL_DIR"]
count = 0
while True:
    if os.path.exists(os.path.join(wd, "capture")):
        os.remove(os.path.join(wd, "capture"))
        for stale in ("ready-for-snapshot", "restore-complete", "snapshot-complete"):
            if os.path.exists(os.path.join(ctl, stale)):
                os.remove(os.path.join(ctl, stale))
        open(os.path.join(ctl, "ready-for-snapshot"), "w").close()
        while True:
            if os.path.exists(os.path.join(ctl, "snapshot-complete")):
                sys.exit(0)
            if os.path.exists(os.path.join(ctl, "restore-complete")):
                ctx_path = os.path.join(ctl, "restore-context.json")
                if os.path.exists(ctx_path):
                    for name, value in json.load(open(ctx_path))["env"].items():
                        if value is None:
                            os.environ.pop(name, None)
                        else:
                            os.environ[name] = value
                os.remove(os.path.join(ctl, "ready-for-snapshot"))
                with open(os.path.join(wd, "env"), "w") as fh:
                    fh.write(os.environ.get("MODE", ""))
                break
            time.sleep(0.1)
    count += 1
    with open(os.path.join(wd, "count"), "w") as fh:
        fh.write(str(count))
    time.sleep(0.05)
