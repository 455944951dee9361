"""The elastic agent's CLI (also installed as `tf-elastic-run`); its flags live in tf_elastic/elastic/agent/cli.py."""
from tf_elastic.elastic.agent.cli import run

if __name__ == "__main__":
    run()
