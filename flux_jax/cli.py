"""What every ``python -m flux_jax.*`` command does around its work.

``run(main)``: starts the distributed runtime (``flux_jax.distributed``) before the command's first
JAX call, runs it, and turns a ``UserError`` into one message on stderr and exit status 2, and a
KeyboardInterrupt (Ctrl-C outside the train loop, which saves and stops on its own) into exit
status 130. Anything else propagates with its traceback.
"""

import sys
from collections.abc import Callable
from typing import NoReturn

from flux_jax import distributed
from flux_jax.errors import UserError

EXIT_USER_ERROR = 2
EXIT_INTERRUPTED = 130  # 128 + SIGINT, as a shell reports a Ctrl-C


def start() -> None:
    """Everything a command needs before its first JAX call."""
    try:
        distributed.initialize()
    except UserError:
        raise
    except ValueError as err:  # a launcher variable set wrongly
        raise UserError(str(err)) from None


def run(main: Callable[[], int | None]) -> NoReturn:
    """Runs ``main()`` as a command: exit status 0 (or main's return value), 2 on a UserError."""
    try:
        start()
        code = main()
    except UserError as err:
        print(f"error: {err}", file=sys.stderr)
        sys.exit(EXIT_USER_ERROR)
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        sys.exit(EXIT_INTERRUPTED)
    sys.exit(code or 0)
