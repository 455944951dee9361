"""Where a worker's world comes from: the agent's `TF_CONFIG`, or TF's Slurm and Kubernetes cluster
resolvers when no agent runs (a fixed-size world that the scheduler restarts after a failure)."""
import json
import os
import shutil
import socket
from typing import Optional

import tensorflow as tf

from tf_elastic.choices import RESOLVERS
from tf_elastic.elastic.protocol import Env
from tf_elastic.elastic.worker.world import World, wait_for_the_agents_world_on_stdin


def resolve_world_and_export_tf_config(resolver: str = "tf_config", port_base: int = 8888,
                                       k8s_selector: Optional[str] = None, k8s_client=None) -> World:
    """This worker's world, with `TF_CONFIG` in `os.environ` saying it (what MultiWorkerMirroredStrategy
    reads). Under the agent, or with `tf_config`: the `TF_CONFIG` it finds (none: one worker); a warm-started
    worker first blocks on stdin until the agent hands it its round (`wait_for_the_agents_world_on_stdin`).

    Without an agent, `slurm` and `kubernetes` ask TF's cluster resolver and write what it says to
    `TF_CONFIG`, which MultiWorkerMirroredStrategy reads. Such a world has a fixed size: the scheduler
    restarts a failed job (Slurm `--requeue`, a Kubernetes restart policy) and `fit` resumes from the
    last commit in the run dir, as Keras' `BackupAndRestore` does. `k8s_client`: a Kubernetes `CoreV1Api`
    (default: the pod's service account, else the kubeconfig).
    """
    if resolver not in RESOLVERS:
        raise ValueError(f"--cluster_resolver must be one of {', '.join(RESOLVERS)}; got {resolver!r}.")
    if resolver == "tf_config":
        wait_for_the_agents_world_on_stdin()
        return World.from_env()
    if any(name in os.environ for name in (Env.WARM, Env.HEARTBEAT_FILE)):
        raise ValueError(f"--cluster_resolver={resolver}: the elastic agent gives this worker its world; "
                         f"use tf_config under the agent (tf-elastic-run).")
    if resolver == "slurm":
        # The resolver gives a node only as many tasks as it has GPUs (it asks nvidia-smi). On a CPU node,
        # let every task of the step fit, and leave CUDA_VISIBLE_DEVICES alone.
        cpu_only = {} if shutil.which("nvidia-smi") else {
            "gpus_per_node": int(os.environ.get("SLURM_STEP_NUM_TASKS", 1)), "gpus_per_task": 1, "auto_set_gpu": False}
        try:
            found = tf.distribute.cluster_resolver.SlurmClusterResolver(port_base=port_base, **cpu_only)
        except RuntimeError as error:  # outside a job step, or more tasks than the step has
            raise ValueError(f"--cluster_resolver=slurm: {error} (start the workers with srun)") from None
        cluster = found.cluster_spec().as_dict()  # (this also sets task_type and task_id)
        task = {"type": found.task_type, "index": found.task_id}
    else:
        if not k8s_selector:
            raise ValueError("--cluster_resolver=kubernetes needs --k8s_selector (the workers' pod label selector, "
                             "for example job-name=my-job).")
        try:
            found = tf.distribute.cluster_resolver.KubernetesClusterResolver(
                {"worker": [k8s_selector]}, tf_server_port=port_base,
                override_client=_OwnNamespace(k8s_client or _kubernetes_api(), _pod_namespace()))
            cluster = found.cluster_spec().as_dict()
        except RuntimeError as error:  # a selected pod is not running (yet): the restart policy tries again
            raise ValueError(f"--cluster_resolver=kubernetes: {error}") from None
        # The resolver lists the pods' node addresses (so: hostNetwork pods, one per node), sorted by pod
        # name ("w-10" before "w-2"): find ourselves by address, not by ordinal.
        mine = f"{socket.gethostbyname(socket.gethostname())}:{port_base}"
        workers = cluster.get("worker", [])
        if workers.count(mine) != 1:
            raise ValueError(f"--k8s_selector={k8s_selector!r} selects {workers}, which should hold this pod's node "
                             f"address {mine} once (hostNetwork pods, one per node).")
        task = {"type": "worker", "index": workers.index(mine)}
    os.environ["TF_CONFIG"] = json.dumps({"cluster": cluster, "task": task})
    return World.from_env()


_NAMESPACE_FILE = "/var/run/secrets/kubernetes.io/serviceaccount/namespace"


def _pod_namespace() -> str:
    """This pod's namespace: POD_NAMESPACE (the downward API), else its service account's, else `default`."""
    if os.environ.get("POD_NAMESPACE"):
        return os.environ["POD_NAMESPACE"]
    try:
        with open(_NAMESPACE_FILE, encoding="utf-8") as f:
            return f.read().strip() or "default"
    except OSError:
        return "default"


class _OwnNamespace:
    """TF's resolver lists pods in every namespace (that needs a ClusterRole, and matches another
    namespace's pods with the same labels); this client answers with this pod's namespace only."""

    def __init__(self, api, namespace: str):
        self.api, self.namespace = api, namespace

    def list_pod_for_all_namespaces(self, label_selector: str):
        return self.api.list_namespaced_pod(self.namespace, label_selector=label_selector)


def _kubernetes_api():
    """The pod's own API access (its service account), else a kubeconfig. (TF's resolver would read a
    kubeconfig only, which a pod does not have.)"""
    try:
        from kubernetes import client, config
    except ImportError:
        raise ValueError("--cluster_resolver=kubernetes needs the kubernetes package: pip install kubernetes") from None
    try:
        config.load_incluster_config()
    except config.ConfigException:
        config.load_kube_config()
    return client.CoreV1Api()


