"""Checks absl cannot express, shared by the agent's and the trainer's command lines."""
import math
import sys
from typing import Sequence

from absl import flags


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
