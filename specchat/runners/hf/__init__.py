"""transformers' forward behind the runner seam (`runner.HFRunner`): any model on any device,
its `DynamicCache` (`kvcache`), the features the head reads (`features`), the row-exact
attention (`attention`), and on a CPU specchat's kernels swapped in under its modules (`cpu`)."""
