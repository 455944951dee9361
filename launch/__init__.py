"""Everything that runs: training, the elastic agent's CLI, benchmarks and paper reproductions."""
