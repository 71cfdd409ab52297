"""torch.nn programs, as the PyTorch tutorials write them (tiny sizes)."""

from __future__ import annotations

import math

import torch
from torch import nn
from torch.nn import functional as F

from .harness import Built, Program


def mlp_sgd() -> Built:
    """Quickstart-style MLP regression with SGD and MSELoss."""
    model = nn.Sequential(
        nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 1)
    )
    loss_fn = nn.MSELoss()
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-2, momentum=0.9)
    xs, ys = torch.randn(4, 16, 8), torch.randn(4, 16, 1)

    def train_step(x, y):
        pred = model(x)
        return loss_fn(pred, y)

    return Built(train_step, lambda k: (xs[k], ys[k]), [model], optimizer)


class ConvNet(nn.Module):
    """The CIFAR-10 tutorial network, smaller, with BatchNorm and Dropout."""

    def __init__(self) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(3, 6, 3)
        self.bn1 = nn.BatchNorm2d(6)
        self.pool = nn.MaxPool2d(2, 2)
        self.conv2 = nn.Conv2d(6, 8, 3)
        self.fc1 = nn.Linear(8 * 2 * 2, 24)
        self.dropout = nn.Dropout(0.25)
        self.fc2 = nn.Linear(24, 10)

    def forward(self, x):
        x = self.pool(F.relu(self.bn1(self.conv1(x))))
        x = self.pool(F.relu(self.conv2(x)))
        x = torch.flatten(x, 1)
        x = self.dropout(F.relu(self.fc1(x)))
        return self.fc2(x)


def cnn_adam() -> Built:
    net = ConvNet()
    criterion = nn.CrossEntropyLoss()
    optimizer = torch.optim.Adam(net.parameters(), lr=1e-3)
    images, labels = torch.randn(4, 8, 3, 14, 14), torch.randint(0, 10, (4, 8))

    def train_step(inputs, targets):
        outputs = net(inputs)
        return criterion(outputs, targets)

    return Built(train_step, lambda k: (images[k], labels[k]), [net], optimizer)


class LSTMTagger(nn.Module):
    """The sequence-models tutorial's part-of-speech tagger."""

    def __init__(self, embedding_dim: int, hidden_dim: int, vocab_size: int, tagset_size: int):
        super().__init__()
        self.word_embeddings = nn.Embedding(vocab_size, embedding_dim)
        self.lstm = nn.LSTM(embedding_dim, hidden_dim)
        self.hidden2tag = nn.Linear(hidden_dim, tagset_size)

    def forward(self, sentence):
        embeds = self.word_embeddings(sentence)
        lstm_out, _ = self.lstm(embeds.view(len(sentence), 1, -1))
        tag_space = self.hidden2tag(lstm_out.view(len(sentence), -1))
        return F.log_softmax(tag_space, dim=1)


def lstm_tagger() -> Built:
    model = LSTMTagger(6, 6, 9, 3)
    loss_function = nn.NLLLoss()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    sentences, tags = torch.randint(0, 9, (4, 5)), torch.randint(0, 3, (4, 5))

    def train_step(sentence_in, targets):
        tag_scores = model(sentence_in)
        return loss_function(tag_scores, targets)

    return Built(train_step, lambda k: (sentences[k], tags[k]), [model], optimizer)


class GRUNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.gru = nn.GRU(4, 16, num_layers=2, batch_first=True, dropout=0.1)
        self.head = nn.Linear(16, 1)

    def forward(self, x):
        out, _ = self.gru(x)
        return self.head(out[:, -1])


def gru_regression() -> Built:
    model = GRUNet()
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    xs, ys = torch.randn(4, 8, 10, 4), torch.randn(4, 8, 1)

    def train_step(x, y):
        return F.mse_loss(model(x), y)

    return Built(train_step, lambda k: (xs[k], ys[k]), [model], optimizer)


class PositionalEncoding(nn.Module):
    """From the nn.TransformerEncoder language-modeling tutorial."""

    def __init__(self, d_model: int, dropout: float = 0.1, max_len: int = 64):
        super().__init__()
        self.dropout = nn.Dropout(p=dropout)
        position = torch.arange(max_len).unsqueeze(1)
        div_term = torch.exp(torch.arange(0, d_model, 2) * (-math.log(10000.0) / d_model))
        pe = torch.zeros(max_len, 1, d_model)
        pe[:, 0, 0::2] = torch.sin(position * div_term)
        pe[:, 0, 1::2] = torch.cos(position * div_term)
        self.register_buffer("pe", pe)

    def forward(self, x):
        x = x + self.pe[: x.size(0)]
        return self.dropout(x)


class TransformerModel(nn.Module):
    def __init__(self, ntoken: int, d_model: int, nhead: int, d_hid: int, nlayers: int):
        super().__init__()
        self.pos_encoder = PositionalEncoding(d_model, 0.1)
        layer = nn.TransformerEncoderLayer(d_model, nhead, d_hid, 0.1)
        self.transformer_encoder = nn.TransformerEncoder(layer, nlayers, enable_nested_tensor=False)
        self.embedding = nn.Embedding(ntoken, d_model)
        self.d_model = d_model
        self.linear = nn.Linear(d_model, ntoken)

    def forward(self, src, src_mask=None):
        src = self.embedding(src) * math.sqrt(self.d_model)
        src = self.pos_encoder(src)
        output = self.transformer_encoder(src, src_mask)
        return self.linear(output)


def transformer_encoder_lm() -> Built:
    ntokens = 20
    model = TransformerModel(ntokens, 16, 2, 32, 2)
    criterion = nn.CrossEntropyLoss()
    optimizer = torch.optim.SGD(model.parameters(), lr=5.0)
    data = torch.randint(0, ntokens, (4, 9, 3))

    def train_step(inputs, targets):
        output = model(inputs)
        return criterion(output.view(-1, ntokens), targets.reshape(-1))

    return Built(
        train_step,
        lambda k: (data[k, :-1], data[k, 1:]),
        [model],
        optimizer,
        after_backward=lambda: torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5),
    )


def nn_transformer_seq2seq() -> Built:
    """nn.Transformer with a causal target mask, as its docs use it."""
    d_model, vocab = 16, 12
    embed = nn.Embedding(vocab, d_model)
    transformer = nn.Transformer(
        d_model=d_model,
        nhead=2,
        num_encoder_layers=1,
        num_decoder_layers=1,
        dim_feedforward=32,
        dropout=0.1,
        batch_first=True,
    )
    head = nn.Linear(d_model, vocab)
    params = [*embed.parameters(), *transformer.parameters(), *head.parameters()]
    optimizer = torch.optim.AdamW(params, lr=1e-3)
    src, tgt = torch.randint(0, vocab, (4, 2, 7)), torch.randint(0, vocab, (4, 2, 6))

    def train_step(src, tgt):
        tgt_in, tgt_out = tgt[:, :-1], tgt[:, 1:]
        tgt_mask = nn.Transformer.generate_square_subsequent_mask(tgt_in.size(1))
        out = transformer(embed(src), embed(tgt_in), tgt_mask=tgt_mask, tgt_is_causal=True)
        logits = head(out)
        return F.cross_entropy(logits.reshape(-1, vocab), tgt_out.reshape(-1))

    return Built(train_step, lambda k: (src[k], tgt[k]), [embed, transformer, head], optimizer)


class RNNModel(nn.Module):
    """pytorch/examples word_language_model: encoder, stacked LSTM with dropout, tied decoder."""

    def __init__(self, ntoken: int, ninp: int, nhid: int, nlayers: int, dropout: float = 0.5):
        super().__init__()
        self.drop = nn.Dropout(dropout)
        self.encoder = nn.Embedding(ntoken, ninp)
        self.rnn = nn.LSTM(ninp, nhid, nlayers, dropout=dropout)
        self.decoder = nn.Linear(nhid, ntoken)
        self.decoder.weight = self.encoder.weight  # tie_weights (ninp == nhid)

    def forward(self, input, hidden):
        emb = self.drop(self.encoder(input))
        output, hidden = self.rnn(emb, hidden)
        output = self.drop(output)
        return F.log_softmax(self.decoder(output), dim=-1), hidden


def lstm_word_language_model() -> Built:
    ntokens = 20
    model = RNNModel(ntokens, 16, 16, 2, dropout=0.2)
    criterion = nn.NLLLoss()
    optimizer = torch.optim.SGD(model.parameters(), lr=1.0)
    data = torch.randint(0, ntokens, (4, 7, 2))
    hidden = (torch.zeros(2, 2, 16), torch.zeros(2, 2, 16))

    def train_step(data, targets, hidden):
        output, hidden = model(data, hidden)
        return criterion(output.view(-1, ntokens), targets.reshape(-1)), hidden

    return Built(
        train_step,
        lambda k: (data[k, :-1], data[k, 1:], hidden),
        [model],
        optimizer,
        after_backward=lambda: torch.nn.utils.clip_grad_norm_(model.parameters(), 0.25),
    )


def pinn_burgers() -> Built:
    """A physics-informed network (Raissi et al.'s Burgers PINN, as commonly written in plain
    torch): PDE residual through torch.autograd.grad(create_graph=True)."""
    net = nn.Sequential(nn.Linear(2, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 1))
    optimizer = torch.optim.Adam(net.parameters(), lr=1e-3)
    nu = 0.01 / math.pi
    colloc = torch.rand(4, 32, 2) * torch.tensor([2.0, 1.0]) - torch.tensor([1.0, 0.0])
    x0 = torch.linspace(-1, 1, 16)

    def train_step(xt, x0):
        xt = xt.clone().requires_grad_(True)
        u = net(xt)
        du = torch.autograd.grad(u, xt, torch.ones_like(u), create_graph=True)[0]
        u_x, u_t = du[:, 0:1], du[:, 1:2]
        u_xx = torch.autograd.grad(u_x, xt, torch.ones_like(u_x), create_graph=True)[0][:, 0:1]
        residual = u_t + u * u_x - nu * u_xx
        u0 = net(torch.stack([x0, torch.zeros_like(x0)], -1))
        return residual.pow(2).mean() + (u0.squeeze(-1) + torch.sin(math.pi * x0)).pow(2).mean()

    return Built(train_step, lambda k: (colloc[k], x0), [net], optimizer)


PROGRAMS = [
    Program("torch_mlp_sgd", "torch", "torch", mlp_sgd, "MLP regression, MSELoss, SGD+momentum"),
    Program(
        "torch_cnn_adam",
        "torch",
        "torch",
        cnn_adam,
        "CIFAR tutorial CNN + BatchNorm + Dropout, CrossEntropy, Adam",
    ),
    Program(
        "torch_lstm_tagger",
        "torch",
        "torch",
        lstm_tagger,
        "sequence-models tutorial LSTM tagger, NLLLoss, SGD",
    ),
    Program(
        "torch_gru_regression",
        "torch",
        "torch",
        gru_regression,
        "2-layer GRU (dropout) + Linear, MSE, Adam",
    ),
    Program(
        "torch_lstm_word_lm",
        "torch",
        "torch",
        lstm_word_language_model,
        "word_language_model example: 2-layer LSTM (dropout 0.2), tied weights, SGD",
    ),
    Program(
        "torch_transformer_encoder_lm",
        "torch",
        "torch",
        transformer_encoder_lm,
        "nn.TransformerEncoder LM tutorial, clip_grad_norm_, SGD",
    ),
    Program(
        "torch_nn_transformer_seq2seq",
        "torch",
        "torch",
        nn_transformer_seq2seq,
        "nn.Transformer with causal tgt mask, AdamW",
    ),
    Program(
        "torch_pinn_burgers",
        "torch",
        "torch",
        pinn_burgers,
        "plain-torch PINN: autograd.grad(create_graph=True) residual, Adam",
    ),
]
