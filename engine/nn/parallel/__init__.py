"""The tensor-parallel building blocks that ``smp.nn``'s distributed modules and the in-place sharding of Hugging Face
blocks are made of: the parallel context they are built in (:mod:`context`), the tensor-parallel group of this rank
(:mod:`group`), its collectives and their autograd rules (:mod:`collectives`), how a parameter is cut into shards
(:mod:`shards`), the random streams (:mod:`rng`), column-, row- and vocabulary-parallel layers (:mod:`layers`),
regions that join and split the group's batch (:mod:`region`), the vocabulary-parallel loss (:mod:`cross_entropy`),
the marks that say which modules become tensor-parallel (:mod:`marks`), ``smp.nn.DistributedLinear`` /
``DistributedEmbedding`` (:mod:`modules`) and what ``DistributedModel`` reads of a parameter's role
(:mod:`introspect`).

They sit in ``nn`` so that the modules built from them never reach up into a parallelism package: the
tensor-parallel package (``smp2ds.engine.tensor_parallel``) applies them to a model, and the pipeline and
checkpoint tools read them, all from above.
"""
