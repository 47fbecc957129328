// Starts a kafkajs transaction and prints the error the client reports.
// Usage: node kafkajs_transaction.mjs BOOTSTRAP TOPIC
import kafkajs from 'kafkajs'

const [bootstrap, topic] = process.argv.slice(2)
const kafka = new kafkajs.Kafka({ clientId: 'kafscale-tx', brokers: [bootstrap], logLevel: kafkajs.logLevel.NOTHING,
  retry: { retries: 2 } })
const producer = kafka.producer({ transactionalId: 'tx-1', idempotent: true, maxInFlightRequests: 1 })
try {
  await producer.connect()
  const tx = await producer.transaction()
  await tx.send({ topic, messages: [{ value: 'x' }] })
  await tx.commit()
  console.log('committed')
} catch (e) {
  console.log(`error ${e.name}: ${e.message} retriable=${e.retriable}`)
}
await producer.disconnect()
