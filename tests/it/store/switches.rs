//! The emergency switches: set, replaced, cleared, expired; the active ones and the history.

use super::*;
use idem::domain::switch::{Clearing, Scope, Switch, SwitchAction};
use idem::store::{ClearSwitch, SwitchCleared};

fn switch(scope: Scope, action: SwitchAction, actor: &str, set_at: Timestamp, expires_at: Option<Timestamp>) -> Switch {
    Switch {
        id: Uuid::now_v7(),
        scope,
        action,
        reason: format!("{actor} saw a storm"),
        actor: actor.into(),
        set_at,
        expires_at,
        cleared: None,
    }
}

fn clearing(actor: &str, at: Timestamp) -> Clearing {
    Clearing { at, actor: actor.into(), reason: format!("{actor} says it is over"), replaced_by: None }
}

fn ids(switches: &[Switch]) -> Vec<Uuid> {
    switches.iter().map(|s| s.id).collect()
}

pub(super) async fn switches_are_set_listed_replaced_and_cleared_with_their_audit(backend: Backend) {
    let (store, _db) = store_on(backend).await;
    let payments = Scope::Route("payments".into());
    assert!(store.active_switches(T0).await.unwrap().is_empty());

    let first = switch(payments.clone(), SwitchAction::RetriesOff, "alice", T0, None);
    assert_eq!(store.set_switch(first.clone()).await.unwrap(), None, "nothing to replace");
    let all = switch(Scope::All, SwitchAction::Isolate, "alice", T0 + ms(1), Some(T0 + ms(60_000)));
    assert_eq!(store.set_switch(all.clone()).await.unwrap(), None, "another scope and action");
    assert_eq!(store.active_switches(T0 + ms(2)).await.unwrap(), vec![first.clone(), all.clone()], "oldest first");

    // The same scope and action again: the active one is replaced, in the same change.
    let second = switch(payments.clone(), SwitchAction::RetriesOff, "bob", T0 + ms(10), None);
    let replaced = store.set_switch(second.clone()).await.unwrap().expect("the first one is replaced");
    assert_eq!(replaced.id, first.id);
    let how = replaced.cleared.clone().unwrap();
    assert_eq!((how.at, how.actor.as_str(), how.replaced_by), (T0 + ms(10), "bob", Some(second.id)));
    assert!(how.reason.contains(&second.id.to_string()) && how.reason.contains("bob saw a storm"), "{}", how.reason);
    assert_eq!(ids(&store.active_switches(T0 + ms(11)).await.unwrap()), vec![all.id, second.id]);

    match store.clear_switch(ClearSwitch { id: second.id, clearing: clearing("carol", T0 + ms(20)) }).await.unwrap() {
        SwitchCleared::Cleared(s) => assert_eq!(s.cleared, Some(clearing("carol", T0 + ms(20)))),
        other => panic!("expected Cleared, got {other:?}"),
    }
    match store.clear_switch(ClearSwitch { id: second.id, clearing: clearing("dave", T0 + ms(21)) }).await.unwrap() {
        SwitchCleared::NotActive(s) => assert_eq!(s.cleared.unwrap().actor, "carol", "the first clearing stands"),
        other => panic!("expected NotActive, got {other:?}"),
    }
    assert!(matches!(
        store.clear_switch(ClearSwitch { id: Uuid::new_v4(), clearing: clearing("dave", T0) }).await.unwrap(),
        SwitchCleared::Missing
    ));
    assert_eq!(ids(&store.active_switches(T0 + ms(22)).await.unwrap()), vec![all.id]);

    // Everything stays in the history, newest first.
    let history = store.switch_history(100).await.unwrap();
    assert_eq!(ids(&history), vec![second.id, all.id, first.id]);
    assert_eq!(history[0].cleared.as_ref().unwrap().actor, "carol");
    assert_eq!(history[1], all, "stored field for field");
    assert_eq!(history[2].cleared.as_ref().unwrap().replaced_by, Some(second.id));
    assert_eq!(ids(&store.switch_history(1).await.unwrap()), vec![second.id]);
}

pub(super) async fn an_expired_switch_is_not_active_not_replaced_and_not_cleared_but_kept(backend: Backend) {
    let (store, _db) = store_on(backend).await;
    let payments = Scope::Route("payments".into());
    let brief = switch(payments.clone(), SwitchAction::Isolate, "alice", T0, Some(T0 + ms(1000)));
    store.set_switch(brief.clone()).await.unwrap();
    assert_eq!(ids(&store.active_switches(T0 + ms(999)).await.unwrap()), vec![brief.id]);
    assert!(store.active_switches(T0 + ms(1000)).await.unwrap().is_empty(), "over at its expiry");

    match store.clear_switch(ClearSwitch { id: brief.id, clearing: clearing("bob", T0 + ms(1000)) }).await.unwrap() {
        SwitchCleared::NotActive(s) => assert_eq!(s.cleared, None),
        other => panic!("expected NotActive, got {other:?}"),
    }
    // A new one of the same scope and action replaces nothing: the old one ended by itself.
    let again = switch(payments, SwitchAction::Isolate, "bob", T0 + ms(2000), None);
    assert_eq!(store.set_switch(again.clone()).await.unwrap(), None);
    let history = store.switch_history(10).await.unwrap();
    assert_eq!(ids(&history), vec![again.id, brief.id]);
    assert_eq!(history[1], brief, "kept as it was set");
}

pub(super) async fn of_concurrent_sets_of_one_scope_and_action_one_stays_active(backend: Backend) {
    let (store, _db) = store_on(backend).await;
    let sets = (0..8).map(|i| {
        let store = store.clone();
        let s = switch(Scope::All, SwitchAction::RetriesOff, &format!("op{i}"), T0 + ms(i), None);
        tokio::spawn(async move { store.set_switch(s).await.unwrap() })
    });
    let mut replaced = 0;
    for set in sets {
        replaced += usize::from(set.await.unwrap().is_some());
    }
    assert_eq!(store.active_switches(T0 + ms(100)).await.unwrap().len(), 1);
    assert_eq!(replaced, 7, "each set but the first replaced the one before it");
    let history = store.switch_history(100).await.unwrap();
    assert_eq!(history.iter().filter(|s| s.cleared.as_ref().is_some_and(|c| c.replaced_by.is_some())).count(), 7);
}
