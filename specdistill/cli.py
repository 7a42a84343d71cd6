"""What every command-line entry shares: a mistake the user can fix (a bad config, Hydra's or ours, a missing
or broken file, stale or corrupted run state) ends in one clear line and exit code 2 (EXIT_USER_ERROR), never
a traceback; anything else is a bug and keeps its traceback and exit code 1."""

from __future__ import annotations

import logging
import sys
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

from omegaconf.errors import MissingMandatoryValue

from specdistill.capture.run import BadSamples
from specdistill.capture.store import FeatureStoreError
from specdistill.config import ConfigError
from specdistill.data.rejects import TooManyRejects
from specdistill.distributed import failing_together, join_launch
from specdistill.engines import EngineNotInstalled
from specdistill.evaluate.bench import BenchError
from specdistill.export.common import ExportError
from specdistill.fingerprint import StaleRun
from specdistill.heads.checkpoint import HeadMismatch
from specdistill.io import CorruptFile, JsonlError
from specdistill.redact import redact_urls
from specdistill.target import TargetNotFound

log = logging.getLogger("specdistill")
T = TypeVar("T")
EXIT_USER_ERROR = 2
_work_started = False  # set when a command's own code first runs: a Hydra exit before that is a config error

USER_ERRORS = (ConfigError, TargetNotFound, BadSamples, FeatureStoreError, TooManyRejects, ExportError,
               FileNotFoundError, JsonlError, BenchError, CorruptFile, StaleRun,
               HeadMismatch, MissingMandatoryValue, EngineNotInstalled)


def exit_on_user_error(work: Callable[[], T]) -> T:
    """Run a command's own work. Hydra has parsed the command line by now, so the URL credentials in it are hidden
    from `sys.argv`, which W&B copies into its run files."""
    global _work_started
    if not _work_started:
        sys.argv[1:] = [redact_urls(arg) for arg in sys.argv[1:]]
    _work_started = True
    try:
        return work()
    except USER_ERRORS as err:
        log.error("%s", err)
        sys.exit(EXIT_USER_ERROR)


def exit_code_of(err: BaseException) -> int:
    return EXIT_USER_ERROR if isinstance(err, USER_ERRORS) else 1


def run_as_one_job(failed_dir: str | Path, work: Callable[[], T]) -> T:
    """`exit_on_user_error` for a command every rank of `accelerate launch --num_processes N` runs: the ranks
    join first, and a failure on any rank ends every rank with that failure named (`failing_together`, which keeps
    its record in `failed_dir`)."""
    return exit_on_user_error(lambda: _joined(Path(failed_dir), work))


def _joined(failed_dir: Path, work: Callable[[], T]) -> T:
    join_launch()
    with failing_together(failed_dir, exit_code_of):
        return work()


def run_main(main: Callable[[], None]) -> None:
    """Call a `@hydra.main` function so that a config Hydra cannot compose (an unknown field, a value of the wrong
    type, a malformed override), which Hydra reports with exit code 1, exits with EXIT_USER_ERROR as well."""
    try:
        main()
    except SystemExit as done:
        if done.code == 1 and not _work_started:
            sys.exit(EXIT_USER_ERROR)
        raise
