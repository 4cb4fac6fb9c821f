"""Applications built on the library, apart from its core (nothing in ``attention``, ``ops``, ``clustering``,
``models``, ``train`` or ``hf`` imports them):

* :mod:`.approx` -- clustered attention inside a pretrained model without retraining (``clusterformer approx``);
* :mod:`.clustering` and :mod:`.som` -- the stand-alone clustering experiment: the neural clustering method vs
  k-means vs a self-organising map (``clusterformer cluster``; needs numpy and scikit-learn);
* :mod:`.demo` -- a benchmark and a short training run (``clusterformer demo``).
"""
