"""A small built-in training text (written for this project), so the demo needs no download."""

TEXT = """\
A NeuronCore is a small machine with four engines that work side by side. The tensor engine
multiplies matrices on a grid of one hundred and twenty eight by one hundred and twenty eight
cells. The vector engine walks along rows of numbers and adds, scales and compares them. The
scalar engine applies one function to every number it is given: an exponent, a logarithm, a
gate. The last engine is a general one, used for the odd jobs that the others cannot do.

Data lives in three places. The high bandwidth memory is large and far away. The state buffer
is small, fast and close, split into one hundred and twenty eight partitions. The partial sum
buffer sits beside the tensor engine and collects the results of each multiplication until the
sum is complete. A good kernel moves a tile of data from the far memory into the state buffer,
lets the engines work on it while the next tile is already on its way, and writes the answer
back when it is done.

A training step is a long list of such kernels. The forward pass turns tokens into vectors,
mixes them with attention, and passes them through small networks. The backward pass walks the
same road in reverse and finds how each weight should change. The optimizer then nudges every
weight a little in the direction that lowers the loss. Step after step the loss goes down and
the model learns to guess the next letter of the text.

When many small kernels run one after another, each one pays to start and each one reads and
writes the far memory. Fusing them into one kernel pays once and keeps the data close. This is
what a compiler does for a whole graph, and what adaptive eager execution does for the short
runs of operations that a program issues one at a time.

The same program can run on many cores. Each core holds a share of the model or of the data,
and the cores talk over fast links to add up their gradients or to pass activations along a
pipeline. The art is to keep every engine busy and every link full, and to never wait.
"""
