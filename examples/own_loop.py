"""Your own training loop as a learner: a jitted step you wrote, a `Session` around it.

The run's config names this file as `model.script` (and a model entry point, which provisions the
run and evaluates it); `diloco learner`, and so `diloco train` and every job backend, runs it as
each learner with the run in the environment:

    diloco train --config configs/local.yaml \\
        --set model.entry=examples.pytree_mlp_lm:spec --set model.script=examples/own_loop.py
"""

import jax
import optax

import diloco
from examples.pytree_mlp_lm import init, loss, spec

with diloco.Session.from_env() as session:
    data = spec(session.cfg).batches(session.shard)        # or any loader of yours
    opt = optax.adam(1e-3)
    params = session.join(init(session.cfg.model.seed))     # the run's global version, in your tree
    opt_state = opt.init(params)

    @jax.jit
    def train_step(params, opt_state, batch):
        value, grads = jax.value_and_grad(loss)(params, batch)
        updates, opt_state = opt.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, value

    for _ in range(session.start_step, session.total_steps):
        if session.stopping:                                 # SIGTERM: hand in and leave
            break
        batch = next(data)
        params, opt_state, value = train_step(params, opt_state, batch)
        params = session.step(params, tokens=int(batch["mask"].sum()), loss=value)
