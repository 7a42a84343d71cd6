"""What every command-line entry shares: a mistake the user can fix ends in one clear line and exit
code 2, never a traceback; anything else is a bug and keeps its traceback."""

from __future__ import annotations

import logging
import sys
from collections.abc import Callable
from typing import TypeVar

from specdistill.capture.run import BadSamples
from specdistill.capture.store import FeatureStoreError
from specdistill.config import ConfigError
from specdistill.data.rejects import TooManyRejects
from specdistill.export.common import ExportError
from specdistill.target import TargetNotFound

log = logging.getLogger("specdistill")
T = TypeVar("T")

USER_ERRORS = (ConfigError, TargetNotFound, BadSamples, FeatureStoreError, TooManyRejects, ExportError,
               FileNotFoundError)


def exit_on_user_error(work: Callable[[], T]) -> T:
    try:
        return work()
    except USER_ERRORS as err:
        log.error("%s", err)
        sys.exit(2)
