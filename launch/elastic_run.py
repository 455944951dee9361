"""The elastic agent's CLI (also installed as `tf-elastic-run`); see tf_elastic/elastic/cli.py for flags."""
from tf_elastic.elastic.agent.cli import run

if __name__ == "__main__":
    run()
