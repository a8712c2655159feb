"""PRM-Lite's historical entry point: re-exports ``airline_rl.rewards.prm`` and runs its command line.

The implementation lives in the ``airline_rl.rewards.prm`` package (detectors, rules, engine, stats, corpus, report).
``python -m airline_rl.rewards.prm_lite --update-docs docs/prm_lite.md`` regenerates the rule table and the
calibration report of docs/prm_lite.md; ``--markdown`` prints the table, ``--calibration`` the report.
"""

from airline_rl.rewards.prm import *  # noqa: F403
from airline_rl.rewards.prm import __all__ as _prm_all
from airline_rl.rewards.prm.report import (
    CALIBRATION_END,
    CALIBRATION_START,
    DOCS_END,
    DOCS_START,
    calibration_markdown,
    main,
    rules_markdown,
    update_docs,
)

__all__ = [
    *_prm_all,
    "CALIBRATION_END",
    "CALIBRATION_START",
    "DOCS_END",
    "DOCS_START",
    "calibration_markdown",
    "main",
    "rules_markdown",
    "update_docs",
]

if __name__ == "__main__":
    raise SystemExit(main())
