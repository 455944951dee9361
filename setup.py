"""Installs `tf_elastic`, with the checkout's `models/` and `launch/` mapped into it as `tf_elastic.models` and
`tf_elastic.launch`: an installed wheel trains without the checkout, and has no top-level `models` or `launch`.
The wheel holds the library (its harness `tf_elastic.testing` included, which the main job runs on) and
`launch/`'s own modules, the commands users run; the benchmarks and paper reproductions in `launch/`'s rooms stay
in the checkout."""
from setuptools import find_packages, setup

setup(
    name="tf_elastic",
    version="0.1.0",
    description="Elastic, large-batch distributed training for TensorFlow/Keras 3: "
    "LARS, Dynamic SGD schedules and an elastic MultiWorkerMirroredStrategy runtime.",
    long_description=open("README.md", encoding="utf-8").read(),
    long_description_content_type="text/markdown",
    python_requires=">=3.10",
    # `launch/`'s own modules are the commands users run; its rooms (`launch/bench`, `launch/papers`) are
    # subpackages not listed here, so the wheel leaves them out by the layout alone.
    packages=find_packages(include=["tf_elastic", "tf_elastic.*"]) + ["tf_elastic.models", "tf_elastic.launch"],
    package_dir={"tf_elastic.models": "models", "tf_elastic.launch": "launch"},
    install_requires=[
        "tensorflow>=2.20,<2.22",
        "keras>=3.10,<4",
        "requests>=2.28",
        "absl-py",
        "tensorboard",  # TF 2.21 no longer pulls it in; tf.summary needs it
        "scikit-learn",  # the `digits` dataset that ships offline: the README's first jobs train on it
    ],
    extras_require={
        # jax: the optimizer math on Keras' JAX backend; optax: the benchmark's reference LARS;
        # matplotlib: plots; scipy: the reproductions' intervals and paired t-tests; tensorflow-datasets (and
        # importlib_resources, which its builders import): the `tfds:NAME` datasets; ruff: the lint CI runs;
        # gcp-storage-emulator (pinned: the harness works around one of its bugs) and cryptography: gs:// durable
        # copies against a local emulator (tf_elastic.testing.gcs);
        # wheel: tests/test_packaging.py builds the wheel without build isolation; moto[server]: a local S3 API
        # for the s3:// tests (tf_elastic.testing.s3); pytest-xdist: two tests at once (pytest.ini).
        "test": ["pytest", "pytest-xdist", "jax", "optax", "matplotlib", "scipy", "tensorflow-datasets>=4.9",
                 "importlib_resources", "ruff", "gcp-storage-emulator==2026.7.19", "cryptography", "wheel",
                 "boto3>=1.28", "moto[server]>=5"],
        # s3:// durable copies (--checkpoint_dir=s3://bucket/prefix) through boto3; 1.28 reads AWS_ENDPOINT_URL.
        "s3": ["boto3>=1.28"],
    },
    entry_points={
        # The elastic agent (launch/elastic_run.py runs the same entry point from a checkout) and the trainer.
        "console_scripts": ["tf-elastic-run=tf_elastic.elastic.agent.cli:run",
                            "tf-elastic-train=tf_elastic.launch.train:run",
                            "tf-elastic-status=tf_elastic.launch.status:run",
                            "tf-elastic-report=tf_elastic.launch.report:run"],
    },
    license="Apache-2.0",
)
