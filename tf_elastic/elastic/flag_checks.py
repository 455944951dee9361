"""Checks absl cannot express, and one way to run a command line, shared by the agent, the trainer, the
status and the report: `--help` exits 0 with a synopsis, a bad flag is one line naming it."""
import math
import sys
from typing import Callable, List, Optional, Sequence

from absl import app, flags


def require_finite_floats(module_name: str, flag_values: flags.FlagValues = flags.FLAGS) -> None:
    """Refuses NaN and infinity for every float flag `module_name` defines: absl's bounds let NaN through
    (NaN compares false), and `--host_ttl=nan` would never expire, `--stop_grace=nan` kill at once."""
    for flag in flag_values.get_key_flags_for_module(module_name):
        if isinstance(flag.parser, flags.FloatParser):
            flags.register_validator(flag.name, lambda v: v is None or math.isfinite(v),
                                     message=f"--{flag.name} must be a finite number", flag_values=flag_values)


HELP = ("-h", "-?", "--help", "--helpshort")


def help_if_asked(arguments: Sequence[str], synopsis: str, module_name: str,
                  flag_values: flags.FlagValues = flags.FLAGS) -> None:
    """Prints `synopsis` and `module_name`'s flags and exits 0 if `arguments` ask for help (absl exits 1 and
    lists only the key flags of the program file, `sys.argv[0]`, which a console script is not)."""
    if not any(argument in HELP for argument in arguments):
        return
    print(synopsis)
    for flag in flag_values.get_key_flags_for_module(module_name):
        flag_values.register_key_flag_for_module(sys.argv[0], flag)
    print(flag_values.module_help(sys.argv[0]))
    sys.exit(0)


def run_program(main: Callable[[List[str]], Optional[int]], program: str, synopsis: str, module_name: str,
                usage_exit: int = 2, arguments: Optional[Sequence[str]] = None) -> None:
    """`app.run(main)`, with `--help` answered by `help_if_asked` and every flag error (absl's own: bounds,
    required flags, validators, unknown flags; and `app.UsageError` from `main`) printed as one line,
    `PROGRAM: error: ... (see --help)`, exiting `usage_exit`; absl would print two lines, or the whole
    help, and exit 1. `arguments`: the ones that may ask for help (default: all of them)."""
    help_if_asked(sys.argv[1:] if arguments is None else arguments, synopsis, module_name)

    def refuse(error: Exception) -> None:
        print(f"{program}: error: {error} (see --help)", file=sys.stderr, flush=True)
        sys.exit(usage_exit)

    def parse(argv: List[str]) -> List[str]:
        try:
            return flags.FLAGS(argv)
        except flags.Error as error:
            refuse(error)

    def guarded(argv: List[str]) -> None:
        try:
            code = main(argv)
        except app.UsageError as error:
            refuse(error)
        sys.exit(code or 0)

    app.run(guarded, flags_parser=parse)
