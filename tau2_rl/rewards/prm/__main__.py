"""``python -m tau2_rl.rewards.prm`` was the report's command line; it is ``python prm_report.py`` now (an entry
script beside the others: it reads domains, files and flags, which ``rewards/`` does not)."""

import sys

if __name__ == "__main__":
    print("python -m tau2_rl.rewards.prm is now: python prm_report.py (the same flags; --help lists them)",
          file=sys.stderr)  # fmt: skip
    raise SystemExit(2)
