"""The elastic agent's CLI (also installed as `tf-elastic-run`); its flags live in tf_elastic/elastic/agent/cli.py."""
from absl import flags

from tf_elastic.elastic.agent import cli

flags.adopt_module_key_flags(cli)  # so that --help lists the agent's flags, not just "Try --helpfull"

if __name__ == "__main__":
    cli.run()
