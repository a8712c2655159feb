"""``accelerate launch`` with one line where accelerate would print a traceback, and a SIGTERM that waits for the
checkpoint (``tau2_rl/run/launch.py`` says what differs). Same flags as ``accelerate launch``:

    python launch.py --config_file accelerate_configs/cpu.yaml train_grpo.py --config recipes/grpo/cpu_smoke.yaml
"""

from __future__ import annotations

import sys

from tau2_rl.run.launch import main

if __name__ == "__main__":
    sys.exit(main())
