"""The agent side: one `ElasticAgent` per host (`agent`), its rendezvous rounds in a store
(`rendezvous`, `round`, `job_record`), the pure rules it follows (`decisions`), port probing (`ports`)
and the `tf-elastic-run` command line (`cli`). Nothing here imports TensorFlow."""
