"""Our benchmarks and soaks: they drive local jobs of real agents and workers through the harness
(`tf_elastic.testing`) and print tables. Checkout only: the wheel holds `launch/`'s own modules, not this room."""
