"""Checks absl cannot express, shared by the agent's and the trainer's command lines."""
import math

from absl import flags


def require_finite_floats(module_name: str, flag_values: flags.FlagValues = flags.FLAGS) -> None:
    """Refuses NaN and infinity for every float flag `module_name` defines: absl's bounds let NaN through
    (NaN compares false), and `--host_ttl=nan` would never expire, `--stop_grace=nan` kill at once."""
    for flag in flag_values.get_key_flags_for_module(module_name):
        if isinstance(flag.parser, flags.FloatParser):
            flags.register_validator(flag.name, lambda v: v is None or math.isfinite(v),
                                     message=f"--{flag.name} must be a finite number", flag_values=flag_values)
