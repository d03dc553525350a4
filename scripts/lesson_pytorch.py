"""The lesson's PyTorch from-scratch data-parallel LeNet (d2l.ai, "Multiple GPUs"), timed on this machine.

The baseline `jdp bench train` compares with (`jdp/bench/baselines.py`). The model, loss, allreduce and
SGD are the lesson's code unchanged; on a CPU-only machine the lesson's `try_all_gpus()` gives one
CPU device, so `train_batch` runs on one device. Data comes from the IDX files in memory (no
DataLoader), so the time is the training step's. PyTorch is not a jdp dependency: install a CPU
wheel in its own venv (`pip install torch numpy`) and run

    python scripts/lesson_pytorch.py --data-dir ../shared/data/fashion-mnist --epochs 3

It prints images/s per epoch and the best epoch (the figure the baseline records). With `--device cuda`
the params live on the GPU and each batch is copied to it from the host, as the lesson's
`nn.parallel.scatter` does (`scripts/gpu_check.sh` runs it so when torch sees a GPU).
"""
import argparse
import gzip
import json
import time

import numpy as np
import torch
from torch import nn
from torch.nn import functional as F


def idx(path):
    with gzip.open(path) as f:
        data = f.read()
    ndim = data[3]
    shape = [int.from_bytes(data[4 + 4 * i: 8 + 4 * i], "big") for i in range(ndim)]
    return np.frombuffer(data, np.uint8, offset=4 + 4 * ndim).reshape(shape)

parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
parser.add_argument("--data-dir", required=True, help="folder with the four Fashion-MNIST IDX files (.gz)")
parser.add_argument("--epochs", type=int, default=3)
parser.add_argument("--batch-size", type=int, default=256)
parser.add_argument("--device", default="cpu", help="torch device: cpu (the baseline) or cuda (one GPU)")
parser.add_argument("--out", default=None, help="write the per-epoch figures as JSON to this file")
args = parser.parse_args()
d = args.data_dir
X = torch.tensor(idx(f"{d}/train-images-idx3-ubyte.gz"), dtype=torch.float32).reshape(-1, 1, 28, 28) / 255
Y = torch.tensor(idx(f"{d}/train-labels-idx1-ubyte.gz").astype(np.int64))
scale = 0.01
torch.manual_seed(0)
W1 = torch.randn(size=(20, 1, 3, 3)) * scale; b1 = torch.zeros(20)
W2 = torch.randn(size=(50, 20, 5, 5)) * scale; b2 = torch.zeros(50)
W3 = torch.randn(size=(800, 128)) * scale; b3 = torch.zeros(128)
W4 = torch.randn(size=(128, 10)) * scale; b4 = torch.zeros(10)
params = [W1, b1, W2, b2, W3, b3, W4, b4]

def lenet(X, params):
    h1 = F.avg_pool2d(F.relu(F.conv2d(input=X, weight=params[0], bias=params[1])), kernel_size=(2, 2), stride=(2, 2))
    h2 = F.avg_pool2d(F.relu(F.conv2d(input=h1, weight=params[2], bias=params[3])), kernel_size=(2, 2), stride=(2, 2))
    h2 = h2.reshape(h2.shape[0], -1)
    h3 = F.relu(torch.mm(h2, params[4]) + params[5])
    return torch.mm(h3, params[6]) + params[7]

loss = nn.CrossEntropyLoss(reduction='none')

def sgd(params, lr, batch_size):
    for param in params:
        param.data.sub_(lr * param.grad / batch_size)
        param.grad.data.zero_()

def get_params(params, device):
    new_params = [p.to(device) for p in params]
    for p in new_params:
        p.requires_grad_()
    return new_params

def allreduce(data):
    for i in range(1, len(data)):
        data[0][:] += data[i].to(data[0].device)
    for i in range(1, len(data)):
        data[i][:] = data[0].to(data[i].device)

def train_batch(X, y, device_params, devices, lr):
    X_shards, y_shards = [X.to(devices[0])], [y.to(devices[0])]  # nn.parallel.scatter on one device
    ls = [loss(lenet(X_shard, device_W), y_shard).sum()
          for X_shard, y_shard, device_W in zip(X_shards, y_shards, device_params)]
    for l in ls:
        l.backward()
    with torch.no_grad():
        for i in range(len(device_params[0])):
            allreduce([device_params[c][i].grad for c in range(len(devices))])
    for param in device_params:
        sgd(param, lr, X.shape[0])

devices = [torch.device(args.device)]
synchronize = torch.cuda.synchronize if devices[0].type == "cuda" else lambda: None
device_params = [get_params(params, d) for d in devices]
B, epochs = args.batch_size, args.epochs
print(f"the lesson's PyTorch code: torch {torch.__version__}, {torch.get_num_threads()} threads, batch {B}, "
      f"on {devices[0]}")
rates, seconds = [], []
for epoch in range(epochs):
    perm = torch.randperm(len(Y))
    start = time.perf_counter()
    for i in range(0, len(Y), B):
        j = perm[i:i + B]
        train_batch(X[j], Y[j], device_params, devices, 0.2)
    synchronize()
    s = time.perf_counter() - start
    rates.append(len(Y) / s)
    seconds.append(s)
    print(f"epoch {epoch + 1}: {s:.2f} s, {len(Y) / s:.0f} images/s", flush=True)
print(f"best epoch: {max(rates):.0f} images/s")
if args.out:
    with open(args.out, "w") as f:
        json.dump({"torch": torch.__version__, "threads": torch.get_num_threads(), "batch_size": B,
                   "device": str(devices[0]), "seconds": seconds, "images_per_s": rates,
                   "best_images_per_s": max(rates)}, f, indent=2)
