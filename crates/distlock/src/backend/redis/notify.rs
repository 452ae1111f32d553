//! One shared pub/sub connection per client, carrying the release announcements of every lock
//! some local task is waiting for, and the progress of the streamed records some local task
//! reads (on the same channel: see `waiters`).
//!
//! The task subscribes a channel when its first local waiter arrives and unsubscribes it when the
//! last one leaves. If the connection breaks it reconnects with backoff, subscribes again to every
//! channel still waited on, and wakes all waiters once, because releases during the outage were
//! missed. Waiters never depend on it alone: they poll with backoff as well.

use std::sync::{Arc, Weak};
use std::time::Duration;

use futures_util::StreamExt;
use tokio::sync::mpsc;

use crate::Backoff;
use crate::backend::waiters::{Command, Waiters};

/// Where a pub/sub connection comes from.
#[derive(Clone)]
pub(crate) enum Source {
    /// A fixed server.
    Client(Box<redis::Client>),
    /// The current master of a Sentinel-managed group, asked again on every reconnect.
    Sentinel(Arc<tokio::sync::Mutex<redis::sentinel::SentinelClient>>),
}

impl Source {
    async fn connect(&self) -> redis::RedisResult<redis::aio::PubSub> {
        match self {
            Source::Client(client) => client.get_async_pubsub().await,
            Source::Sentinel(sentinel) => {
                let client = sentinel.lock().await.async_get_client().await?;
                client.get_async_pubsub().await
            }
        }
    }
}

/// Starts one pub/sub task per source and returns the registry that feeds them. The tasks end
/// when the registry is dropped.
pub(crate) fn spawn_notifiers(sources: Vec<Source>, op_timeout: Duration) -> Arc<Waiters> {
    let mut feeds = Vec::with_capacity(sources.len());
    let mut receivers = Vec::with_capacity(sources.len());
    for _ in &sources {
        let (tx, rx) = mpsc::unbounded_channel();
        feeds.push(tx);
        receivers.push(rx);
    }
    let waiters = Waiters::with_feeds(feeds);
    let weak = Arc::downgrade(&waiters);
    waiters.start_with(Box::new(move |runtime| {
        for (source, rx) in sources.into_iter().zip(receivers) {
            runtime.spawn(run(source, weak.clone(), rx, op_timeout));
        }
    }));
    waiters
}

/// Whether a subscription was refused by the server's ACL (a user without channel rights, as
/// with Redis 7's `acl-pubsub-default resetchannels`): retrying cannot fix it.
fn refused(result: &Result<redis::RedisResult<()>, tokio::time::error::Elapsed>) -> bool {
    matches!(result, Ok(Err(e)) if e.kind() == redis::ErrorKind::Server(redis::ServerErrorKind::NoPerm))
}

/// Notifications are refused for good: says so once, and answers every subscription request
/// with "not subscribed" (the waiters poll) until the client is gone.
async fn refuse_forever(commands: &mut mpsc::UnboundedReceiver<Command>, error: String) {
    tracing::warn!(
        %error,
        "lock notifications refused by the server (no pub/sub channel rights): waiters poll instead"
    );
    while commands.recv().await.is_some() {}
}

async fn run(
    source: Source,
    waiters: Weak<Waiters>,
    mut commands: mpsc::UnboundedReceiver<Command>,
    op_timeout: Duration,
) {
    let mut backoff = Backoff::new(Duration::from_millis(50), Duration::from_secs(2));
    loop {
        let connected = tokio::time::timeout(op_timeout, source.connect()).await;
        let pubsub = match connected {
            Ok(Ok(pubsub)) => pubsub,
            Ok(Err(e)) => {
                tracing::debug!(error = %e, "lock notifications: connect failed, waiters poll");
                if !idle(&mut commands, backoff.next_delay()).await {
                    return;
                }
                continue;
            }
            Err(_) => {
                tracing::debug!("lock notifications: connect timed out, waiters poll");
                if !idle(&mut commands, backoff.next_delay()).await {
                    return;
                }
                continue;
            }
        };
        let (mut sink, mut stream) = pubsub.split();
        let Some(registry) = waiters.upgrade() else {
            return;
        };
        let channels = registry.channels();
        if !channels.is_empty() {
            let subscribed = tokio::time::timeout(op_timeout, sink.subscribe(&channels)).await;
            if refused(&subscribed) {
                drop(registry);
                return refuse_forever(&mut commands, format!("{subscribed:?}")).await;
            }
            if !matches!(subscribed, Ok(Ok(()))) {
                // Not a hot loop: wait before connecting again.
                drop(registry);
                if !idle(&mut commands, backoff.next_delay()).await {
                    return;
                }
                continue;
            }
            backoff.reset();
        }
        // Releases announced while we were not subscribed were missed: let everyone look again.
        registry.wake_all();
        drop(registry);

        loop {
            tokio::select! {
                command = commands.recv() => match command {
                    None => return,
                    Some(Command::Subscribe(channel, ack)) => {
                        let subscribed =
                            tokio::time::timeout(op_timeout, sink.subscribe(&channel)).await;
                        if refused(&subscribed) {
                            return refuse_forever(&mut commands, format!("{subscribed:?}")).await;
                        }
                        match subscribed {
                            Ok(Ok(())) => {
                                backoff.reset();
                                ack.confirm();
                            }
                            _ => break,
                        }
                    }
                    Some(Command::Unsubscribe(channel)) => {
                        let Some(registry) = waiters.upgrade() else { return };
                        if !registry.is_waited(&channel) {
                            drop(registry);
                            if !matches!(
                                tokio::time::timeout(op_timeout, sink.unsubscribe(&channel)).await,
                                Ok(Ok(()))
                            ) {
                                break;
                            }
                        }
                    }
                },
                message = stream.next() => match message {
                    None => break,
                    Some(message) => {
                        let Some(registry) = waiters.upgrade() else { return };
                        registry.wake(message.get_channel_name(), message.get_payload_bytes());
                    }
                },
            }
        }
        tracing::debug!("lock notifications: connection lost, reconnecting");
        if !idle(&mut commands, backoff.next_delay()).await {
            return;
        }
    }
}

/// Waits `delay` while answering commands (subscriptions cannot be made now: the waiters poll).
/// Returns false when the client is gone.
async fn idle(commands: &mut mpsc::UnboundedReceiver<Command>, delay: Duration) -> bool {
    let sleep = tokio::time::sleep(delay);
    tokio::pin!(sleep);
    loop {
        tokio::select! {
            _ = &mut sleep => return true,
            command = commands.recv() => match command {
                // Dropping the acknowledgement tells the waiter to rely on polling.
                Some(_) => {}
                None => return false,
            },
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Publishes an announcement; returns how many subscribers received it.
    async fn publish(server: &testkit::RedisServer, channel: &str) -> i64 {
        let mut conn = server.connection().await;
        redis::cmd("PUBLISH")
            .arg(channel)
            .arg("")
            .query_async(&mut conn)
            .await
            .unwrap()
    }

    /// The release announcement wakes a waiter over the shared connection, and after the server
    /// restarts the task resubscribes by itself.
    #[tokio::test]
    async fn announcements_wake_waiters_and_survive_a_restart() {
        let server = testkit::RedisServer::start_owned().await;
        let waiters = spawn_notifiers(
            vec![Source::Client(Box::new(server.client()))],
            Duration::from_secs(2),
        );
        let mut waiter = waiters.register("p:{k}:rel");
        assert!(
            waiter.subscribed(Duration::from_secs(10)).await,
            "subscription confirmed"
        );
        assert_eq!(
            publish(&server, "p:{k}:rel").await,
            1,
            "one shared subscriber"
        );
        tokio::time::timeout(Duration::from_secs(10), waiter.notified())
            .await
            .expect("woken by the announcement");

        server.stop().await;
        server.restart().await;
        // The task reconnects and subscribes again by itself: an announcement reaches it.
        let mut received = 0;
        for _ in 0..200 {
            received = publish(&server, "p:{k}:rel").await;
            if received == 1 {
                break;
            }
            tokio::time::sleep(Duration::from_millis(25)).await;
        }
        assert_eq!(received, 1, "resubscribed after the restart");
        tokio::time::timeout(Duration::from_secs(10), waiter.notified())
            .await
            .expect("woken after the restart");
        // The last waiter leaving unsubscribes the channel.
        drop(waiter);
        let mut remaining = 1;
        for _ in 0..200 {
            remaining = publish(&server, "p:{k}:rel").await;
            if remaining == 0 {
                break;
            }
            tokio::time::sleep(Duration::from_millis(25)).await;
        }
        assert_eq!(remaining, 0, "unsubscribed when nobody waits");
    }
}
