"""The pure math both stages share: costs, proxies, inclusion probabilities, draws, importance weights and the J ratio
(plain torch, no TRL). Nothing in this folder imports another folder of the package."""
