//! Changes made by other processes, heard through PostgreSQL's `LISTEN/NOTIFY`: the trigger of
//! `migrations/postgres` notifies on [`CHANNEL`], and one listening connection per process relays
//! each notification as a [`Notice`].

use std::time::Duration;

use sqlx::postgres::{PgListener, PgPool};
use tokio::sync::{broadcast, oneshot};
use uuid::Uuid;

use crate::domain::RecordId;
use crate::store::{Notice, StoreError};

/// The channel the trigger of `migrations/postgres` notifies on.
const CHANNEL: &str = "idem_records";

/// A listener on the server `pool` connects to now: it follows the pool to a new primary.
pub(super) async fn listen(pool: &PgPool) -> Result<PgListener, StoreError> {
    let mut listener = PgListener::connect_with(pool).await?;
    listener.listen(CHANNEL).await?;
    Ok(listener)
}

/// Forwards notifications until the store is dropped. `PgListener` reconnects by itself after a
/// dropped connection; when that fails too, the listener is rebuilt after a growing pause.
/// Notifications sent while disconnected are lost: subscribers must not rely on them alone.
pub(super) async fn relay_notices(
    pool: PgPool,
    mut listener: PgListener,
    notices: broadcast::Sender<Notice>,
    mut stop: oneshot::Receiver<()>,
) {
    let mut pause = Duration::from_millis(100);
    loop {
        let failure = tokio::select! {
            _ = &mut stop => return,
            failure = forward(&mut listener, &notices) => failure,
        };
        tracing::warn!(error = %failure, "lost the store's notification channel; reconnecting");
        loop {
            tokio::select! {
                _ = &mut stop => return,
                _ = tokio::time::sleep(pause) => {}
            }
            pause = (pause * 2).min(Duration::from_secs(10));
            match listen(&pool).await {
                Ok(fresh) => {
                    listener = fresh;
                    pause = Duration::from_millis(100);
                    break;
                }
                Err(e) => tracing::warn!(error = %e, "cannot listen for store notifications"),
            }
        }
    }
}

/// Relays notifications until the listener fails.
async fn forward(listener: &mut PgListener, notices: &broadcast::Sender<Notice>) -> StoreError {
    loop {
        match listener.try_recv().await {
            Ok(Some(notification)) => match parse_notice(notification.payload()) {
                // No subscriber is not an error: nobody is waiting right now.
                Some(notice) => drop(notices.send(notice)),
                None => tracing::warn!(payload = notification.payload(), "unexpected store notification"),
            },
            // The connection dropped and was re-established; notifications in between are lost.
            Ok(None) => tracing::warn!("store notification connection was re-established"),
            Err(e) => return e.into(),
        }
    }
}

fn parse_notice(payload: &str) -> Option<Notice> {
    let (kind, id) = payload.split_once(':')?;
    let id = RecordId(Uuid::parse_str(id).ok()?);
    match kind {
        "settled" => Some(Notice::Settled(id)),
        "queued" => Some(Notice::Queued(id)),
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn notifications_are_read_as_notices_and_anything_else_is_ignored() {
        let id = RecordId(Uuid::new_v4());
        assert_eq!(parse_notice(&format!("settled:{id}")), Some(Notice::Settled(id)));
        assert_eq!(parse_notice(&format!("queued:{id}")), Some(Notice::Queued(id)));
        assert_eq!(parse_notice(&format!("deleted:{id}")), None);
        assert_eq!(parse_notice("queued:not-a-uuid"), None);
        assert_eq!(parse_notice("queued"), None);
    }
}
