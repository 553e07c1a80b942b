"""The fault campaign (`python -m faults.campaign`): stacks broken on purpose under load, judged for hung,
wrong and unclear answers and leaked KV blocks; and hosts made of Linux network namespaces joined by a
cable with controllable delay, loss and cuts."""
