"""PhiFlow programs in the style of PhiFlow's demos and documentation, written here as plain
step functions (``step(*state) -> state``), for ``tests/test_phiflow_programs.py`` and
``benchmarks/bench_phiflow.py`` (issue "PhiFlow users' whole toolbox"):

* ``heat``: implicit diffusion of a noisy temperature field (CG solve);
* ``burgers``: viscous Burgers' equation on a periodic vector field;
* ``reaction_diffusion``: Gray-Scott reaction-diffusion of two species;
* ``smoke3d``: a 3D smoke plume (buoyancy, MacCormack advection, pressure solve);
* ``particles``: a point cloud advected through a divergence-free flow;
* ``obstacle_flow``: a flow around a box obstacle with an inflow, 'CG-adaptive'.

Each maker takes a resolution and returns the step and a state with the steady structure.
:func:`smoke_match` is of another kind: optimization through a simulation (PhiFlow's
differentiate demos), a loss to jit and differentiate, and its starting point.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from phi.torch.flow import (
    PERIODIC,
    ZERO_GRADIENT,
    Box,
    CenteredGrid,
    Noise,
    Obstacle,
    PointCloud,
    Solve,
    Sphere,
    StaggeredGrid,
    advect,
    channel,
    diffuse,
    field,
    fluid,
    instance,
    math,
    resample,
)

Step = Callable[..., Any]
Program = Callable[[int], tuple[Step, tuple[Any, ...]]]


def heat(n: int) -> tuple[Step, tuple[Any, ...]]:
    temperature = CenteredGrid(Noise(scale=10), ZERO_GRADIENT, x=n, y=n, bounds=Box(x=100, y=100))

    def heat_step(t: Any) -> tuple[Any]:
        return (diffuse.implicit(t, 0.5, 1.0, solve=Solve("CG", 1e-5, 1e-5)),)

    return heat_step, (temperature,)


def burgers(n: int) -> tuple[Step, tuple[Any, ...]]:
    velocity = CenteredGrid(Noise(vector="x,y"), PERIODIC, x=n, y=n, bounds=Box(x=10, y=10))

    def burgers_step(v: Any) -> tuple[Any]:
        v = diffuse.explicit(v, 0.1, 0.1)
        return (advect.semi_lagrangian(v, v, 0.1),)

    return burgers_step, (velocity,)


def reaction_diffusion(n: int) -> tuple[Step, tuple[Any, ...]]:
    u = CenteredGrid(1.0, PERIODIC, x=n, y=n, bounds=Box(x=n, y=n))
    v = CenteredGrid(Sphere(x=n / 2, y=n / 2, radius=n / 8), PERIODIC, x=n, y=n, bounds=u.bounds)
    feed, kill, du, dv, dt = 0.037, 0.06, 0.2, 0.1, 1.0

    def gray_scott_step(u: Any, v: Any) -> tuple[Any, Any]:
        uvv = u * v * v
        u_next = u + dt * (du * field.laplace(u) - uvv + feed * (1 - u))
        v_next = v + dt * (dv * field.laplace(v) + uvv - (feed + kill) * v)
        return u_next, v_next

    return gray_scott_step, (u, v * 0.5)


def smoke3d(n: int) -> tuple[Step, tuple[Any, ...]]:
    bounds = Box(x=n, y=n, z=n)
    velocity = StaggeredGrid(0, 0, x=n, y=n, z=n, bounds=bounds)
    smoke = CenteredGrid(0, ZERO_GRADIENT, x=n, y=n, z=n, bounds=bounds)
    inflow = CenteredGrid(
        Sphere(x=n / 2, y=2, z=n / 2, radius=2), ZERO_GRADIENT, x=n, y=n, z=n, bounds=bounds
    )

    def smoke3d_step(v: Any, s: Any) -> tuple[Any, Any]:
        s = advect.mac_cormack(s, v, 1.0) + inflow * 0.2
        buoyancy = resample(s * (0, 0.1, 0), to=v)
        v = advect.semi_lagrangian(v, v, 1.0) + buoyancy
        # 1e-4: a float32 CG on 32^3 cells stalls near 1e-5 at some steps (NotConverged)
        v, _ = fluid.make_incompressible(v, (), Solve("CG", 1e-4, 1e-4, x0=None))
        return v, s

    return smoke3d_step, smoke3d_step(velocity, smoke)


def particles(n: int) -> tuple[Step, tuple[Any, ...]]:
    bounds = Box(x=n, y=n)
    flow = StaggeredGrid(Noise(vector="x,y", scale=n), 0, x=n, y=n, bounds=bounds)
    flow, _ = fluid.make_incompressible(flow, (), Solve("CG", 1e-5, 1e-5))
    math.seed(0)
    start = math.random_uniform(instance(points=64), channel(vector="x,y")) * n
    cloud = PointCloud(start, bounds=bounds)

    def particle_step(points: Any, v: Any) -> tuple[Any, Any]:
        return advect.points(points, v, 0.5, integrator=advect.rk4), v

    return particle_step, (cloud, flow)


def obstacle_flow(n: int) -> tuple[Step, tuple[Any, ...]]:
    bounds = Box(x=2 * n, y=n)
    velocity = StaggeredGrid((1.0, 0), ZERO_GRADIENT, x=2 * n, y=n, bounds=bounds)
    obstacle = Obstacle(Box(x=(n / 2, n / 2 + 4), y=(n / 3, 2 * n / 3)))

    def obstacle_step(v: Any, p: Any) -> tuple[Any, Any]:
        v = advect.semi_lagrangian(v, v, 1.0)
        return fluid.make_incompressible(v, (obstacle,), Solve("CG-adaptive", 1e-5, 1e-5, x0=p))

    return obstacle_step, obstacle_step(velocity, None)


def smoke_match(n: int) -> tuple[Step, Any]:
    """The loss of an initial velocity: smoke advected by it for two steps (each made
    incompressible) against a target, as PhiFlow's differentiate demos write one; the loss is
    what a user jits, ``field.functional_gradient`` of it what they call."""
    bounds = Box(x=n, y=n)
    smoke = CenteredGrid(Sphere(x=n / 2, y=n / 3, radius=n / 6), ZERO_GRADIENT, x=n, y=n,
                         bounds=bounds)  # fmt: skip
    target = CenteredGrid(Sphere(x=n / 2, y=n / 2, radius=n / 6), ZERO_GRADIENT, x=n, y=n,
                          bounds=bounds)  # fmt: skip

    def loss(v0: Any) -> Any:
        v, s = v0, smoke
        for _ in range(2):
            s = advect.mac_cormack(s, v, 1.0)
            v = advect.semi_lagrangian(v, v, 1.0)
            v, _ = fluid.make_incompressible(v, (), Solve("CG", 1e-5, 1e-5))
        return field.l2_loss(s - target)

    start = StaggeredGrid(0, 0, x=n, y=n, bounds=bounds)
    return loss, start


PROGRAMS: dict[str, Program] = {
    "heat": heat,
    "burgers": burgers,
    "reaction_diffusion": reaction_diffusion,
    "smoke3d": smoke3d,
    "particles": particles,
    "obstacle_flow": obstacle_flow,
}
