"""Installs the `tf_elastic` library only; `models/` and `launch/` run from the checkout."""
from setuptools import find_packages, setup

setup(
    name="tf_elastic",
    version="0.1.0",
    description="Elastic, large-batch distributed training for TensorFlow/Keras 3: "
    "LARS, Dynamic SGD schedules and an elastic MultiWorkerMirroredStrategy runtime.",
    long_description=open("README.md", encoding="utf-8").read(),
    long_description_content_type="text/markdown",
    python_requires=">=3.10",
    packages=find_packages(include=["tf_elastic", "tf_elastic.*"]),
    install_requires=[
        "tensorflow>=2.20,<2.22",
        "keras>=3.10,<4",
        "absl-py",
    ],
    extras_require={
        # jax runs the optimizer math on Keras' JAX backend in one test;
        # matplotlib draws the paper-reproduction plots.
        "test": ["pytest", "jax", "matplotlib"],
    },
    entry_points={
        # Reserved for the elastic agent's CLI (launch/elastic_run.py).
        "console_scripts": [],
    },
    license="Apache-2.0",
)
