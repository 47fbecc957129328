// A kafkajs consumer-group member: appends "PARTITION OFFSET" per record it
// processed and "joined" per group join to OUT; leaves the group on SIGTERM.
// Usage: node kafkajs_member.mjs BOOTSTRAP GROUP TOPIC OUT
import { appendFileSync } from 'node:fs'
import kafkajs from 'kafkajs'

const [bootstrap, group, topic, out] = process.argv.slice(2)
const kafka = new kafkajs.Kafka({ clientId: 'kafscale-test', brokers: [bootstrap], logLevel: kafkajs.logLevel.WARN })
const consumer = kafka.consumer({ groupId: group, sessionTimeout: 10000, heartbeatInterval: 1000 })
consumer.on(consumer.events.GROUP_JOIN, () => appendFileSync(out, 'joined\n'))
consumer.on(consumer.events.CRASH, e => { appendFileSync(out, `crash ${e.payload.error}\n`); process.exit(1) })
await consumer.connect()
await consumer.subscribe({ topic, fromBeginning: true })
await consumer.run({
  eachMessage: async ({ partition, message }) => appendFileSync(out, `${partition} ${message.offset}\n`)
})
process.on('SIGTERM', async () => { await consumer.disconnect(); process.exit(0) })
