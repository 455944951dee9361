"""A plain-NumPy LARS, written from the formulas in the LARS issue, and a backend-neutral check against it.

Kept free of TensorFlow so that the same check runs on Keras' JAX backend in a subprocess.
"""
import numpy as np


def reference_step(w, g, v, lr, *, momentum, weight_decay, trust_coefficient, epsilon, nesterov,
                   classic_momentum, decays, adapts):
    """One LARS step for one variable in float64; returns (new w, new v)."""
    w, g, v = (np.asarray(a, np.float64) for a in (w, g, v))
    beta = weight_decay if decays else 0.0
    d = g + beta * w

    def trust(direction, beta_term):
        w_norm, d_norm = np.linalg.norm(w), np.linalg.norm(direction)
        if not adapts or w_norm == 0 or d_norm == 0:
            return 1.0
        return trust_coefficient * w_norm / (d_norm + beta_term * w_norm + epsilon)

    if classic_momentum:
        scaled = lr * trust(g, beta) * d
        v = momentum * v + scaled
        step = momentum * v + scaled if nesterov else v
    else:
        v = momentum * v + d
        u = momentum * v + d if nesterov else v
        step = lr * trust(u, 0.0) * u
    return w - step, v


def check_optimizer_against_reference(optimizer_kwargs, decays=None, adapts=None, steps=5, seed=0, rtol=1e-5,
                                      atol=1e-7):
    """Drives LARS with random gradients on kernel-, bias- and scale-shaped variables and compares.

    Variables: a 2-D kernel, a zero bias (norm 0 at the start: the guard), a rank-1 scale, a 4-D conv
    kernel and one variable whose gradient is zero (the other guard). `decays`/`adapts` are the masks the
    caller expects (default: rank > 1, the optimizer's default). Raises AssertionError on mismatch.
    """
    import keras

    from tf_elastic import LARS

    rng = np.random.default_rng(seed)
    inits = {
        "dense/kernel": rng.standard_normal((6, 5)) * 0.3,
        "dense/bias": np.zeros(5),
        "bn/gamma": 1.0 + rng.standard_normal(5) * 0.1,
        "conv/kernel": rng.standard_normal((3, 3, 2, 4)) * 0.2,
        "frozen/kernel": rng.standard_normal((4, 4)) * 0.2,
    }
    variables = [keras.Variable(value.astype(np.float32), name=path.replace("/", "_")) for path, value in inits.items()]
    optimizer = LARS(**optimizer_kwargs)
    optimizer.build(variables)
    kw = {k: optimizer_kwargs.get(k, default) for k, default in (
        ("momentum", 0.9), ("weight_decay", 0.0), ("trust_coefficient", 0.001), ("epsilon", 0.0),
        ("nesterov", False), ("classic_momentum", True))}
    by_rank = [len(v.shape) > 1 for v in variables]
    decays, adapts = decays or by_rank, adapts or by_rank
    weights = [np.asarray(v.numpy(), np.float64) for v in variables]
    velocities = [np.zeros_like(w) for w in weights]
    schedule = optimizer_kwargs.get("learning_rate", 1.0)
    for step in range(steps):
        grads = [rng.standard_normal(w.shape) * 0.1 for w in weights]
        grads[-1] = np.zeros_like(grads[-1])
        optimizer.apply([g.astype(np.float32) for g in grads], variables)
        lr = float(schedule(step)) if callable(schedule) else float(schedule)
        for i in range(len(weights)):
            weights[i], velocities[i] = reference_step(
                weights[i], grads[i], velocities[i], lr, decays=decays[i], adapts=adapts[i], **kw)
        for variable, expected in zip(variables, weights):
            np.testing.assert_allclose(variable.numpy(), expected, rtol=rtol, atol=atol,
                                       err_msg=f"step {step} variable {variable.name}")
    return variables, weights
