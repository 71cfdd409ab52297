"""Programs from ML libraries, as their documentation writes them (tiny sizes, random data):
e3nn, normflows, gpytorch, torch_geometric."""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F

from .harness import Built, Program

# --- e3nn ------------------------------------------------------------------------------------


def e3nn_tensor_product_conv() -> Built:
    """e3nn "Convolution" guide: spherical harmonics of edge vectors, a FullyConnectedTensorProduct
    whose weights come from an MLP of radial embeddings, scatter-sum to nodes (fixed graph)."""
    from e3nn import o3
    from e3nn.math import soft_one_hot_linspace
    from e3nn.nn import FullyConnectedNet

    irreps_input = o3.Irreps("4x0e + 2x1o")
    irreps_sh = o3.Irreps.spherical_harmonics(lmax=2)
    irreps_output = o3.Irreps("4x0e + 2x1o")
    tp = o3.FullyConnectedTensorProduct(
        irreps_input, irreps_sh, irreps_output, shared_weights=False
    )
    fc = FullyConnectedNet([10, 16, tp.weight_numel], torch.relu)
    num_nodes, max_radius, num_basis = 8, 1.5, 10
    pos = torch.randn(4, num_nodes, 3)
    feats = irreps_input.randn(4, num_nodes, -1)
    src = torch.arange(num_nodes).repeat_interleave(num_nodes - 1)
    dst = torch.tensor([j for i in range(num_nodes) for j in range(num_nodes) if j != i])
    optimizer = torch.optim.Adam([*tp.parameters(), *fc.parameters()], lr=1e-2)

    def train_step(pos, f_in):
        edge_vec = pos[src] - pos[dst]
        sh = o3.spherical_harmonics(irreps_sh, edge_vec, True, normalization="component")
        emb = soft_one_hot_linspace(
            edge_vec.norm(dim=1), 0.0, max_radius, num_basis, basis="smooth_finite", cutoff=True
        ).mul(num_basis**0.5)
        summand = tp(f_in[src], sh, fc(emb))
        f_out = torch.zeros(num_nodes, summand.shape[1]).index_add(0, dst, summand)
        f_out = f_out.div((num_nodes - 1) ** 0.5)
        return f_out.pow(2).mean(), f_out

    return Built(train_step, lambda k: (pos[k], feats[k]), [tp, fc], optimizer)


def e3nn_gate_network() -> Built:
    """e3nn Gate (equivariant nonlinearity) between two o3.Linear layers, Adam."""
    from e3nn import o3
    from e3nn.nn import Gate

    gate = Gate("8x0e", [torch.relu], "4x0e", [torch.sigmoid], "4x1o")
    lin1 = o3.Linear("4x0e + 2x1o", gate.irreps_in)
    lin2 = o3.Linear(gate.irreps_out, "1x0e + 1x1o")
    model = nn.Sequential(lin1, gate, lin2)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    xs = o3.Irreps("4x0e + 2x1o").randn(4, 16, -1)
    ys = torch.randn(4, 16, 4)

    def train_step(x, y):
        return F.mse_loss(model(x), y)

    return Built(train_step, lambda k: (xs[k], ys[k]), [model], optimizer)


def _e3nn_potential(radial: str) -> Built:
    """An equivariant interatomic potential built from e3nn's parts: spherical harmonics and a
    radial embedding of the edges, a tensor product convolution to per-atom features, a linear
    readout summed to the energy; forces ``-grad(E, pos, create_graph=True)``; trained on
    energies and forces with Adam. ``radial``: ``"smooth_finite"`` (e3nn's Convolution guide,
    ``soft_one_hot_linspace``, whose cutoff step is a custom ``autograd.Function``) or
    ``"bessel"`` (sine Bessel functions under a polynomial cutoff, as NequIP and MACE write it)."""
    import math

    from e3nn import o3
    from e3nn.math import soft_one_hot_linspace
    from e3nn.nn import FullyConnectedNet

    irreps_sh = o3.Irreps.spherical_harmonics(lmax=2)
    tp = o3.FullyConnectedTensorProduct("4x0e", irreps_sh, "4x0e + 2x1o", shared_weights=False)
    fc = FullyConnectedNet([8, 16, tp.weight_numel], torch.nn.functional.silu)
    readout = o3.Linear("4x0e + 2x1o", "1x0e")
    num_atoms, max_radius, num_basis = 6, 2.5, 8
    generator = torch.Generator().manual_seed(3)
    positions = torch.randn(4, num_atoms, 3, generator=generator)
    kinds = F.one_hot(torch.randint(0, 4, (num_atoms,), generator=generator), 4).float()
    energies, forces = torch.randn(4, generator=generator), torch.randn(4, num_atoms, 3)
    src = torch.arange(num_atoms).repeat_interleave(num_atoms - 1)
    dst = torch.tensor([j for i in range(num_atoms) for j in range(num_atoms) if j != i])
    optimizer = torch.optim.Adam([*tp.parameters(), *fc.parameters(), *readout.parameters()])
    frequencies = torch.arange(1, num_basis + 1) * math.pi / max_radius

    def embed(length: torch.Tensor) -> torch.Tensor:
        if radial == "smooth_finite":
            return soft_one_hot_linspace(
                length, 0.0, max_radius, num_basis, basis="smooth_finite", cutoff=True
            ).mul(num_basis**0.5)
        r = length[:, None]
        bessel = (2 / max_radius) ** 0.5 * torch.sin(frequencies * r) / r
        u = (r / max_radius).clamp(max=1.0)  # the polynomial envelope (p = 6)
        return bessel * (1 - 28 * u**6 + 48 * u**7 - 21 * u**8)

    def train_step(pos, energy, force):
        pos = pos.clone().requires_grad_(True)
        edge_vec = pos[src] - pos[dst]
        sh = o3.spherical_harmonics(irreps_sh, edge_vec, True, normalization="component")
        messages = tp(kinds[src], sh, fc(embed(edge_vec.norm(dim=1))))
        atoms = torch.zeros(num_atoms, messages.shape[1]).index_add(0, dst, messages)
        e = readout(atoms).sum()
        (grad,) = torch.autograd.grad(e, pos, create_graph=True)
        return (e - energy).pow(2) + (-grad - force).pow(2).mean(), e

    return Built(
        train_step, lambda k: (positions[k], energies[k], forces[k]), [tp, fc, readout], optimizer
    )


def e3nn_potential_forces() -> Built:
    """The potential with e3nn's Convolution-guide embedding (a custom Function on the way of
    the forces' gradient)."""
    return _e3nn_potential("smooth_finite")


def e3nn_potential_bessel_forces() -> Built:
    """The potential with a NequIP/MACE-style Bessel embedding (torch ops only)."""
    return _e3nn_potential("bessel")


# --- normflows --------------------------------------------------------------------------------


def normflows_realnvp() -> Built:
    """normflows README: RealNVP (AffineCouplingBlock + Permute) on 2-D data, forward KLD."""
    import normflows as nf

    base = nf.distributions.base.DiagGaussian(2)
    flows = []
    for _ in range(4):
        param_map = nf.nets.MLP([1, 16, 16, 2], init_zeros=True)
        flows.append(nf.flows.AffineCouplingBlock(param_map))
        flows.append(nf.flows.Permute(2, mode="swap"))
    model = nf.NormalizingFlow(base, flows)
    optimizer = torch.optim.Adam(model.parameters(), lr=5e-4, weight_decay=1e-5)
    data = torch.randn(4, 32, 2) * torch.tensor([1.0, 0.3]) + torch.tensor([0.5, -0.2])

    def train_step(x):
        return model.forward_kld(x)

    return Built(train_step, lambda k: (data[k],), [model], optimizer)


def normflows_neural_spline() -> Built:
    """normflows neural spline flow (AutoregressiveRationalQuadraticSpline + LULinearPermute),
    trained by forward KLD on 2-D data."""
    import normflows as nf

    flows = []
    for _ in range(2):
        flows.append(nf.flows.AutoregressiveRationalQuadraticSpline(2, 1, 16))
        flows.append(nf.flows.LULinearPermute(2))
    model = nf.NormalizingFlow(nf.distributions.DiagGaussian(2, trainable=False), flows)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3, weight_decay=1e-5)
    data = torch.randn(4, 32, 2) * 1.5

    def train_step(x):
        return model.forward_kld(x)

    return Built(train_step, lambda k: (data[k],), [model], optimizer)


def normflows_reverse_kld() -> Built:
    """normflows real_nvp example: reverse KLD against a TwoMoons target, samples from the base
    distribution drawn inside the loss (torch RNG)."""
    import normflows as nf

    target = nf.distributions.TwoMoons()
    flows = []
    for _ in range(4):
        param_map = nf.nets.MLP([1, 16, 2], init_zeros=True)
        flows.append(nf.flows.AffineCouplingBlock(param_map))
        flows.append(nf.flows.Permute(2, mode="swap"))
    model = nf.NormalizingFlow(nf.distributions.DiagGaussian(2), flows, target)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)

    def train_step():
        return model.reverse_kld(num_samples=32)

    return Built(train_step, lambda k: (), [model], optimizer)


# --- gpytorch ---------------------------------------------------------------------------------


def gpytorch_exact_gp() -> Built:
    """gpytorch "Simple GP Regression": ExactGP, ScaleKernel(RBFKernel), exact marginal LL."""
    import math

    import gpytorch

    train_x = torch.linspace(0, 1, 20)
    train_y = torch.sin(train_x * (2 * math.pi)) + torch.randn(train_x.size()) * math.sqrt(0.04)

    class ExactGPModel(gpytorch.models.ExactGP):
        def __init__(self, train_x, train_y, likelihood):
            super().__init__(train_x, train_y, likelihood)
            self.mean_module = gpytorch.means.ConstantMean()
            self.covar_module = gpytorch.kernels.ScaleKernel(gpytorch.kernels.RBFKernel())

        def forward(self, x):
            mean_x = self.mean_module(x)
            covar_x = self.covar_module(x)
            return gpytorch.distributions.MultivariateNormal(mean_x, covar_x)

    likelihood = gpytorch.likelihoods.GaussianLikelihood()
    model = ExactGPModel(train_x, train_y, likelihood)
    model.train()
    likelihood.train()
    optimizer = torch.optim.Adam(model.parameters(), lr=0.1)
    mll = gpytorch.mlls.ExactMarginalLogLikelihood(likelihood, model)

    def train_step(train_x, train_y):
        output = model(train_x)
        return -mll(output, train_y)

    return Built(train_step, lambda k: (train_x, train_y), [model], optimizer)


def gpytorch_svgp() -> Built:
    """gpytorch "SVGP Regression": ApproximateGP, VariationalStrategy, VariationalELBO."""
    import gpytorch
    from gpytorch.models import ApproximateGP
    from gpytorch.variational import CholeskyVariationalDistribution, VariationalStrategy

    class GPModel(ApproximateGP):
        def __init__(self, inducing_points):
            variational_distribution = CholeskyVariationalDistribution(inducing_points.size(0))
            variational_strategy = VariationalStrategy(
                self, inducing_points, variational_distribution, learn_inducing_locations=True
            )
            super().__init__(variational_strategy)
            self.mean_module = gpytorch.means.ConstantMean()
            self.covar_module = gpytorch.kernels.ScaleKernel(gpytorch.kernels.RBFKernel())

        def forward(self, x):
            mean_x = self.mean_module(x)
            covar_x = self.covar_module(x)
            return gpytorch.distributions.MultivariateNormal(mean_x, covar_x)

    train_x = torch.rand(64, 2)
    train_y = torch.sin(train_x[:, 0] * 3) + 0.1 * torch.randn(64)
    model = GPModel(inducing_points=train_x[:8])
    likelihood = gpytorch.likelihoods.GaussianLikelihood()
    model.train()
    likelihood.train()
    optimizer = torch.optim.Adam(
        [{"params": model.parameters()}, {"params": likelihood.parameters()}], lr=0.01
    )
    mll = gpytorch.mlls.VariationalELBO(likelihood, model, num_data=train_y.size(0))

    def train_step(x_batch, y_batch):
        output = model(x_batch)
        return -mll(output, y_batch)

    return Built(
        train_step,
        lambda k: (train_x[16 * k : 16 * (k + 1)], train_y[16 * k : 16 * (k + 1)]),
        [model, likelihood],
        optimizer,
    )


# --- torch_geometric --------------------------------------------------------------------------


def _random_graph(num_nodes: int = 20, num_features: int = 8, num_classes: int = 3):
    from torch_geometric.data import Data
    from torch_geometric.utils import to_undirected

    edge_index = to_undirected(torch.randint(0, num_nodes, (2, 50)), num_nodes=num_nodes)
    x = torch.randn(num_nodes, num_features)
    y = torch.randint(0, num_classes, (num_nodes,))
    train_mask = torch.rand(num_nodes) < 0.5
    return Data(x=x, edge_index=edge_index, y=y, train_mask=train_mask)


def pyg_gcn() -> Built:
    """PyG "Introduction by Example": two GCNConv layers, dropout, nll_loss on train_mask."""
    from torch_geometric.nn import GCNConv

    class GCN(nn.Module):
        def __init__(self, num_features: int, num_classes: int):
            super().__init__()
            self.conv1 = GCNConv(num_features, 16)
            self.conv2 = GCNConv(16, num_classes)

        def forward(self, x, edge_index):
            x = self.conv1(x, edge_index)
            x = F.relu(x)
            x = F.dropout(x, training=self.training)
            x = self.conv2(x, edge_index)
            return F.log_softmax(x, dim=1)

    data = _random_graph()
    model = GCN(8, 3)
    optimizer = torch.optim.Adam(model.parameters(), lr=0.01, weight_decay=5e-4)

    def train_step(x, edge_index, y, train_mask):
        out = model(x, edge_index)
        return F.nll_loss(out[train_mask], y[train_mask])

    return Built(
        train_step, lambda k: (data.x, data.edge_index, data.y, data.train_mask), [model], optimizer
    )


def pyg_gat() -> Built:
    """PyG examples/gat.py: GATConv with 4 heads, ELU, dropout on features and attention."""
    from torch_geometric.nn import GATConv

    class GAT(nn.Module):
        def __init__(self, in_channels: int, hidden: int, out_channels: int, heads: int):
            super().__init__()
            self.conv1 = GATConv(in_channels, hidden, heads, dropout=0.6)
            self.conv2 = GATConv(hidden * heads, out_channels, heads=1, concat=False, dropout=0.6)

        def forward(self, x, edge_index):
            x = F.dropout(x, p=0.6, training=self.training)
            x = F.elu(self.conv1(x, edge_index))
            x = F.dropout(x, p=0.6, training=self.training)
            return self.conv2(x, edge_index)

    data = _random_graph()
    model = GAT(8, 4, 3, heads=4)
    optimizer = torch.optim.Adam(model.parameters(), lr=0.005, weight_decay=5e-4)

    def train_step(x, edge_index, y, train_mask):
        out = model(x, edge_index)
        return F.cross_entropy(out[train_mask], y[train_mask])

    return Built(
        train_step, lambda k: (data.x, data.edge_index, data.y, data.train_mask), [model], optimizer
    )


def pyg_gin_graph_classification() -> Built:
    """PyG graph classification: GINConv + global_add_pool over a mini-batch of graphs
    (DataLoader-style Batch), CrossEntropy, Adam."""
    from torch_geometric.data import Batch
    from torch_geometric.nn import GINConv, global_add_pool

    class GIN(nn.Module):
        def __init__(self, in_channels: int, hidden: int, out_channels: int):
            super().__init__()
            self.conv1 = GINConv(
                nn.Sequential(nn.Linear(in_channels, hidden), nn.ReLU(), nn.Linear(hidden, hidden))
            )
            self.conv2 = GINConv(
                nn.Sequential(nn.Linear(hidden, hidden), nn.ReLU(), nn.Linear(hidden, hidden))
            )
            self.lin = nn.Linear(hidden, out_channels)

        def forward(self, x, edge_index, batch):
            x = self.conv1(x, edge_index).relu()
            x = self.conv2(x, edge_index).relu()
            x = global_add_pool(x, batch)
            return self.lin(x)

    batches = []
    for _ in range(4):
        graphs = [_random_graph(num_nodes=6 + i) for i in range(3)]
        for i, g in enumerate(graphs):
            g.y = torch.tensor([i % 2])
        batches.append(Batch.from_data_list(graphs))
    model = GIN(8, 16, 2)
    optimizer = torch.optim.Adam(model.parameters(), lr=0.01)

    def train_step(x, edge_index, batch, y):
        out = model(x, edge_index, batch)
        return F.cross_entropy(out, y)

    return Built(
        train_step,
        lambda k: (batches[k].x, batches[k].edge_index, batches[k].batch, batches[k].y),
        [model],
        optimizer,
    )


PROGRAMS = [
    Program(
        "e3nn_tensor_product_conv",
        "e3nn",
        "e3nn",
        e3nn_tensor_product_conv,
        "Convolution guide: spherical_harmonics, FullyConnectedTensorProduct with MLP weights",
    ),
    Program(
        "e3nn_gate_network",
        "e3nn",
        "e3nn",
        e3nn_gate_network,
        "o3.Linear -> Gate -> o3.Linear, MSE, Adam",
    ),
    Program(
        "e3nn_potential_forces",
        "e3nn",
        "e3nn",
        e3nn_potential_forces,
        "interatomic potential: tensor product convolution, energy, forces by autograd.grad, "
        "trained on both, Adam",
    ),
    Program(
        "e3nn_potential_bessel_forces",
        "e3nn",
        "e3nn",
        e3nn_potential_bessel_forces,
        "the same potential with a Bessel radial basis and polynomial cutoff (NequIP, MACE)",
    ),
    Program(
        "normflows_realnvp_forward_kld",
        "normflows",
        "normflows",
        normflows_realnvp,
        "RealNVP (AffineCouplingBlock, Permute), forward_kld, Adam",
    ),
    Program(
        "normflows_neural_spline",
        "normflows",
        "normflows",
        normflows_neural_spline,
        "AutoregressiveRationalQuadraticSpline + LULinearPermute, forward_kld",
    ),
    Program(
        "normflows_reverse_kld",
        "normflows",
        "normflows",
        normflows_reverse_kld,
        "RealNVP reverse_kld against TwoMoons (samples drawn in the loss)",
    ),
    Program(
        "gpytorch_exact_gp",
        "gpytorch",
        "gpytorch",
        gpytorch_exact_gp,
        "Simple GP Regression: ExactGP RBF, ExactMarginalLogLikelihood, Adam",
    ),
    Program(
        "gpytorch_svgp",
        "gpytorch",
        "gpytorch",
        gpytorch_svgp,
        "SVGP: VariationalStrategy, CholeskyVariationalDistribution, VariationalELBO",
    ),
    Program(
        "pyg_gcn",
        "torch-geometric",
        "torch_geometric",
        pyg_gcn,
        "Introduction by Example: 2x GCNConv, dropout, nll_loss on a mask",
    ),
    Program(
        "pyg_gat",
        "torch-geometric",
        "torch_geometric",
        pyg_gat,
        "examples/gat.py: GATConv 4 heads, attention dropout",
    ),
    Program(
        "pyg_gin_graph_classification",
        "torch-geometric",
        "torch_geometric",
        pyg_gin_graph_classification,
        "GINConv + global_add_pool on a Batch of 3 graphs",
    ),
]
