"""`semi_sync`: the round's ledger (who trained which samples, what a lost replica's samples become) and one replica's
side of a sync. The syncs themselves, over real groups, with replicas killed between and during them, are tested end
to end in tests/e2e/test_semi_synchronous.py."""

from __future__ import annotations

import torch
from torch import nn

from monarch_plugin.worker.semi_sync import Round, SemiSync


def _round() -> Round:
    return Round([list(range(0, 6)), list(range(6, 12)), list(range(12, 18))], members=[0, 1, 2])


def test_each_member_trains_its_share_of_every_batch_of_the_round():
    ledger = _round()
    assert ledger.trained == {0: [[0, 1], [6, 7], [12, 13]], 1: [[2, 3], [8, 9], [14, 15]],
                              2: [[4, 5], [10, 11], [16, 17]]}
    assert ledger.weight(1) == 1 / 3 and ledger.samples() == list(range(18))


def test_a_lost_members_samples_are_cut_over_the_others_as_global_batches_and_learned_once():
    ledger = _round()
    extra = ledger.regroup([0, 2])
    assert extra == {0: [[2, 3, 8]], 2: [[9, 14, 15]]}  # its 6 samples: one global batch of 6, cut in two
    assert ledger.samples() == list(range(18)) and 1 not in ledger.trained
    assert ledger.weight(0) == ledger.weight(2) == 0.5


def test_a_newcomer_in_the_sync_takes_its_part_of_the_lost_samples_and_one_that_trained_nothing_weighs_nothing():
    ledger = _round()
    extra = ledger.regroup([0, 2, 5])
    assert extra == {0: [[2, 3]], 2: [[8, 9]], 5: [[14, 15]]}
    assert ledger.samples() == list(range(18))
    assert [ledger.weight(r) for r in (0, 2, 5)] == [8 / 18, 8 / 18, 2 / 18]
    assert _round().regroup([0, 1, 2]) == {0: [], 1: [], 2: []}  # nobody lost: nothing to train again
    fresh = _round()
    fresh.regroup([0, 1, 2, 7])
    assert fresh.weight(7) == 0.0


def test_a_second_loss_hands_on_what_the_lost_replica_had_taken_over_and_a_ledger_travels_as_plain_data():
    ledger = _round()
    ledger.regroup([0, 2])
    moved = Round.from_state(ledger.state_dict())  # what a newcomer healed mid-sync receives
    assert moved.regroup([0, 9]) == ledger.regroup([0, 9])
    assert sorted(ledger.trained) == [0, 9] and ledger.samples() == list(range(18))


def test_a_sync_steps_the_outer_optimizer_from_the_synced_parameters_with_the_pseudo_gradient():
    torch.manual_seed(0)
    model = nn.Linear(3, 1)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    semi = SemiSync(model, "diloco", 4, torch.optim.SGD(model.parameters(), lr=0.5))
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)  # what local steps did
    semi.pseudo_gradients()
    assert all(torch.equal(p.grad, torch.full_like(p, -1.0)) for p in model.parameters())
    with semi.synced_parameters():  # a checkpoint's view mid-round
        assert all(torch.equal(p, before[n]) for n, p in model.named_parameters())
    assert all(torch.equal(p, before[n] + 1) for n, p in model.named_parameters())
    semi.outer_step()  # alone: the mean pseudo-gradient is its own
    for n, p in model.named_parameters():
        assert torch.allclose(p, before[n] + 0.5) and torch.equal(semi.synced[n], p.detach())
    assert semi.syncs == 1 and all(p.grad is None for p in model.parameters())


def test_local_sgd_is_the_mean_of_the_parameters_and_a_replica_that_trained_nothing_sums_zero_metrics():
    model = nn.Linear(2, 1)
    semi = SemiSync(model, "local_sgd", 4, None)
    assert semi.outer.defaults["lr"] == 1.0 and semi.outer.defaults["momentum"] == 0
    semi.start([[0, 1]], members=[0], schedule={})
    semi.add_metrics({"loss": torch.tensor(2.0, dtype=torch.float64), "seen": torch.ones(3, dtype=torch.float64)})
    other = SemiSync(nn.Linear(2, 1), "local_sgd", 4, None)
    other.load_state_dict(semi.state_dict(), rid=3)
    metrics = other.round_metrics()
    assert list(metrics) == ["loss", "seen"] and [v.tolist() for v in metrics.values()] == [0.0, [0.0, 0.0, 0.0]]


def test_a_replica_healed_into_a_sync_trains_again_what_the_ledger_says_it_trained_and_a_newcomer_owes_nothing():
    """A member that dropped the sync its peers committed is healed to their state, in which the round they started
    counts it among its members: the ledger credits it with shares its healed state never learned."""
    donor = SemiSync(nn.Linear(2, 1), "diloco", 3, None)
    donor.start([list(range(0, 6)), list(range(6, 12)), list(range(12, 18))], members=[0, 1, 2], schedule={})
    behind = SemiSync(nn.Linear(2, 1), "diloco", 3, None)
    behind.load_state_dict(donor.state_dict(), rid=1)
    assert behind.owed == [[2, 3], [8, 9], [14, 15]]
    fresh = SemiSync(nn.Linear(2, 1), "diloco", 3, None)
    fresh.load_state_dict(donor.state_dict(), rid=7)
    assert fresh.owed == [] and fresh.round.trained == donor.round.trained


def test_tied_weights_are_served_synced_under_every_name_they_have():
    model = nn.Sequential(nn.Embedding(4, 3), nn.Linear(3, 4, bias=False))
    model[1].weight = model[0].weight  # tied, as a language model's input and output embeddings
    semi = SemiSync(model, "diloco", 4, None)
    with torch.no_grad():
        model[0].weight.add_(1.0)  # local steps
    served = {**model.state_dict(), **semi.synced_state()}
    assert set(semi.synced_state()) == {"0.weight", "1.weight"}
    assert torch.equal(served["1.weight"], semi.synced["0.weight"]) and not torch.equal(served["1.weight"],
                                                                                         model[0].weight)
