"""The one exception type users see.

A `GptflowError` message is a single line that names what is wrong, where (config key, file,
line) and how to fix it. The CLI prints it without a traceback and exits non-zero
(:func:`failure_code`); anything else escaping is a bug and keeps its traceback.
"""

import contextlib
import sys
import traceback
from collections.abc import Iterator


class GptflowError(Exception):
    """User-facing error: bad input, bad config, or an environment problem the user can fix."""


@contextlib.contextmanager
def report_errors(log_path: str) -> Iterator[None]:
    """For workflow scripts: stderr goes to `log_path`; a GptflowError becomes one line there
    and exit status 1 (no traceback), anything else keeps its traceback."""
    with open(log_path, "a") as log:
        sys.stderr = log
        try:
            yield
        except GptflowError as e:
            print(f"error: {e}", file=log)
            log.flush()
            sys.exit(1)
        except Exception:
            traceback.print_exc(file=log)
            log.flush()
            raise
        finally:
            sys.stderr = sys.__stderr__


def failure_code(command: str, e: BaseException) -> int:
    """The exit status of subcommand `command` after `e`, said on stderr: bad input
    (GptflowError) in one line, 130 after Ctrl-C, anything else (a bug) with its traceback."""
    if isinstance(e, GptflowError):
        print(f"gptflow {command}: error: {e}", file=sys.stderr)
        return 1
    if isinstance(e, KeyboardInterrupt):
        return 130
    traceback.print_exception(e)
    return 1
